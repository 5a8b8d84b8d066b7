"""Text in, text out: the checkpoint's own tokenizer, chat template and generation defaults.

Everything is read from the model folder (tokenizer.json, tokenizer_config.json, chat_template.jinja /
chat_template.json, generation_config.json); nothing from the checkpoint is executed. The chat template is
rendered in jinja2's immutable sandbox with the globals transformers gives templates
(`raise_exception`, `strftime_now`), so templates written for transformers render the same here, within a
budget of seconds and characters (runtime/template.py): a template that loops, recurses or grows without
end is a TextError naming it and the limit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence

from porter.errors import TextError
from porter.format.safe_files import present, read_json_object, read_text
from runtime.template import TemplateBudget, TemplateLimit, render

log = logging.getLogger("porter.runtime")

# Generation settings a generation_config.json may give and generate() may override.
SAMPLING_KEYS = ("max_new_tokens", "do_sample", "temperature", "top_p", "top_k")
DEFAULT_MAX_NEW_TOKENS = 128  # when neither the call nor generation_config.json says
DEFAULT_BUDGET = TemplateBudget()  # what rendering a chat template may spend (runtime/template.py)


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
    chat_template_file: Optional[Path] = None  # where the chat template was read from
    template_budget: TemplateBudget = DEFAULT_BUDGET

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
            self.chat_template,
            origin=str(self.chat_template_file or self.path.parent),
            budget=self.template_budget,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **self.special,
        )


def render_template(source: str, origin: str = "", budget: TemplateBudget = DEFAULT_BUDGET, **context) -> str:
    """A chat template rendered in the budgeted sandbox (runtime/template.py). Whatever goes wrong is the
    template's doing (it is someone else's program): one TextError naming it (`origin`) and what happened."""
    import jinja2

    where = f"chat template ({origin})" if origin else "chat template"

    def raise_exception(message):
        raise TextError(f"{where}: {message}")

    try:
        return render(source, budget, {"raise_exception": raise_exception}, **context)
    except TextError:
        raise
    except TemplateLimit as e:
        raise TextError(f"{where}: {e}; fix the template, or prompt without the chat template") from None
    except jinja2.TemplateError as e:
        raise TextError(f"{where}: {e.__class__.__name__}: {' '.join(str(e).split())}") from None
    except RecursionError:
        raise TextError(f"{where}: recursion deeper than Python allows; fix the template") from None
    except Exception as e:  # noqa: BLE001 — any other error raised while rendering is the template's own
        raise TextError(f"{where}: {e.__class__.__name__}: {' '.join(str(e).split())}") from None


def _chat_template(folder: Path, tok_config: dict) -> tuple[Optional[str], Optional[Path]]:
    """(the chat template, the file it is read from)."""
    jinja = folder / "chat_template.jinja"
    if present(jinja, TextError, "chat template"):
        return read_text(jinja, TextError, "chat template"), jinja
    as_json = folder / "chat_template.json"
    if present(as_json, TextError):
        template, where = _read_json(as_json).get("chat_template"), as_json
    else:
        template, where = tok_config.get("chat_template"), folder / "tokenizer_config.json"
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return (template, where) if isinstance(template, str) else (None, None)


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
    template, template_file = _chat_template(folder, cfg)
    return Tokenizer(
        backend,
        path,
        special.get("bos_token"),
        special.get("eos_token"),
        special.get("pad_token"),
        template,
        special,
        template_file,
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
