"""Text in, text out: the checkpoint's own tokenizer, chat template and generation defaults.

Everything is read from the model folder (tokenizer.json, tokenizer_config.json, chat_template.jinja /
chat_template.json, generation_config.json); nothing from the checkpoint is executed. The chat template is
rendered in jinja2's immutable sandbox with the globals transformers gives templates
(`raise_exception`, `strftime_now`), so templates written for transformers render the same here.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Optional, Sequence

from porter.errors import TextError
from porter.format.safe_files import present, read_json_object, read_text

log = logging.getLogger("porter.runtime")

# Generation settings a generation_config.json may give and generate() may override.
SAMPLING_KEYS = ("max_new_tokens", "do_sample", "temperature", "top_p", "top_k")
DEFAULT_MAX_NEW_TOKENS = 128  # when neither the call nor generation_config.json says


def _read_json(path: Path) -> dict:
    return read_json_object(path, TextError)


def _token_text(value) -> Optional[str]:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings: generation_config.json's values, overridden per call (None = keep)."""

    eos_token_ids: tuple = ()
    pad_token_id: Optional[int] = None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut

    @classmethod
    def from_dict(cls, raw: dict, where: str = "generation_config.json") -> "GenerationConfig":
        eos = raw.get("eos_token_id")
        eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
        if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos):
            raise TextError(
                f"{where}: eos_token_id must be a token id or a list of them, found {raw['eos_token_id']!r}"
            )
        pad = raw.get("pad_token_id")
        base = cls(eos_token_ids=tuple(eos), pad_token_id=pad if isinstance(pad, int) else None)
        return base.with_overrides(
            where=where, **{k: raw[k] for k in SAMPLING_KEYS if raw.get(k) is not None}
        )

    def with_overrides(self, where: str = "generate()", **given) -> "GenerationConfig":
        given = {k: v for k, v in given.items() if v is not None}
        if "eos_token_id" in given:
            eos = given.pop("eos_token_id")
            given["eos_token_ids"] = tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        out = replace(self, **given)
        out._check(where)
        return out

    def _check(self, where: str) -> None:
        import math

        t, p, k, n = self.temperature, self.top_p, self.top_k, self.max_new_tokens
        bad = (
            (
                "max_new_tokens",
                n,
                isinstance(n, int) and not isinstance(n, bool) and n >= 0,
                "an integer >= 0",
            ),
            ("temperature", t, isinstance(t, (int, float)) and math.isfinite(t) and t >= 0, "a number >= 0"),
            ("top_p", p, isinstance(p, (int, float)) and math.isfinite(p) and 0 < p <= 1, "in (0, 1]"),
            ("top_k", k, isinstance(k, int) and not isinstance(k, bool) and k >= 0, "an integer >= 0"),
        )
        for name, value, ok, want in bad:
            if not ok:
                raise TextError(f"{where}: {name}={value!r} must be {want}")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0


@dataclass
class Tokenizer:
    """The checkpoint's tokenizer (tokenizers' Tokenizer) plus its special tokens and chat template."""

    backend: object  # tokenizers.Tokenizer
    path: Path
    bos_token: Optional[str] = None
    eos_token: Optional[str] = None
    pad_token: Optional[str] = None
    chat_template: Optional[str] = None
    special: dict = field(default_factory=dict)  # every *_token of tokenizer_config.json, for templates

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TextError(f"a prompt must be text (str), found {type(text).__name__}")
        try:
            text.encode("utf-8")  # lone surrogates: bytes that were not UTF-8 on the command line
        except UnicodeEncodeError:
            raise TextError(f"prompt {text!r} is not valid UTF-8 text; pass text") from None
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def pad_token_id(self) -> Optional[int]:
        return None if self.pad_token is None else self.backend.token_to_id(self.pad_token)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        """The conversation rendered by the checkpoint's chat template (jinja2 sandbox, as transformers)."""
        if self.chat_template is None:
            raise TextError(
                f"{self.path.parent}: the checkpoint has no chat template (tokenizer_config.json "
                "chat_template, chat_template.jinja or chat_template.json); prompt without --chat"
            )
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return render_template(
            self.chat_template, messages=messages, add_generation_prompt=add_generation_prompt, **self.special
        )


def render_template(source: str, **context) -> str:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TextError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(source).render(**context)
    except TextError:
        raise
    except jinja2.TemplateError as e:
        raise TextError(f"chat template: {e.__class__.__name__}: {e}") from None


def _chat_template(folder: Path, tok_config: dict) -> Optional[str]:
    jinja = folder / "chat_template.jinja"
    if present(jinja, TextError, "chat template"):
        return read_text(jinja, TextError, "chat template")
    as_json = folder / "chat_template.json"
    template = (
        _read_json(as_json).get("chat_template")
        if present(as_json, TextError)
        else tok_config.get("chat_template")
    )
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def load_tokenizer(folder) -> Optional[Tokenizer]:
    """The folder's tokenizer, or None when it has no tokenizer.json."""
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not present(path, TextError, "tokenizer"):  # stat first: a FIFO would block the tokenizer's open
        return None
    from tokenizers import Tokenizer as Backend

    try:
        backend = Backend.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception subclass for any malformed file
        raise TextError(
            f"{path}: not a tokenizer file the tokenizers library can read ({e}); "
            "replace it with the checkpoint's own"
        ) from None
    cfg_path = folder / "tokenizer_config.json"
    cfg = _read_json(cfg_path) if present(cfg_path, TextError) else {}
    special = {
        k: _token_text(v) for k, v in cfg.items() if k.endswith("_token") and _token_text(v) is not None
    }
    return Tokenizer(
        backend,
        path,
        special.get("bos_token"),
        special.get("eos_token"),
        special.get("pad_token"),
        _chat_template(folder, cfg),
        special,
    )


def load_generation_config(folder, tokenizer: Optional[Tokenizer]) -> GenerationConfig:
    """generation_config.json's defaults; EOS falls back to the tokenizer's eos_token."""
    path = Path(folder) / "generation_config.json"
    cfg = (
        GenerationConfig.from_dict(_read_json(path), str(path))
        if present(path, TextError)
        else GenerationConfig()
    )
    if not cfg.eos_token_ids and tokenizer is not None and tokenizer.eos_token is not None:
        eos = tokenizer.backend.token_to_id(tokenizer.eos_token)
        cfg = cfg if eos is None else replace(cfg, eos_token_ids=(eos,))
    return cfg
