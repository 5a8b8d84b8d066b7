"""The journal write of a finished shard (a file write with fsync) runs outside the pipeline's lock: another
thread can take that lock while it runs, so workers do not stall behind each shard's fsync."""
import threading
import time

import porter
import porter.conversion as conversion
import porter.pipeline as pp


def test_journal_is_written_outside_the_pipeline_lock(tiny_vendor, tmp_path, monkeypatch):
    engines, free = [], []
    real_init, real_write = pp.Pipeline.__init__, conversion._write_journal

    def init(self, *args, **kwargs):
        engines.append(self)
        real_init(self, *args, **kwargs)

    def write(out, journal):
        if engines and journal.get("shards"):  # a shard's record (the first write, before any, has none)
            got = []

            def take():  # from another thread: can the pipeline's lock be had while the journal is written?
                got.append(engines[-1].lock.acquire(timeout=2))
                if got[0]:
                    engines[-1].lock.release()
            probe = threading.Thread(target=take)
            probe.start()
            probe.join()
            free.append(got[0])
        real_write(out, journal)
    monkeypatch.setattr(pp.Pipeline, "__init__", init)
    monkeypatch.setattr(conversion, "_write_journal", write)
    out = porter.convert(tiny_vendor, tmp_path / "out", max_shard_size="300KB", progress=False, workers=3,
                         device="cpu")
    assert out["shards"] > 1 and len(free) == out["shards"], (out["shards"], free)
    assert all(free), free


def test_workers_do_not_wait_for_the_journal_and_its_failure_fails_the_run(tiny_vendor, tmp_path, monkeypatch):
    """Shard records are written by the journal thread: with one worker, units still finish while the first
    record's write is held up (written by the worker itself, none could), and a failed write (a full disk)
    fails the conversion with no index written."""
    import pytest
    real_write, real_run_unit = conversion._write_journal, pp.Pipeline._run_unit
    holding, held_once, finished_while_held = threading.Event(), threading.Event(), []

    def run_unit(self, u):
        real_run_unit(self, u)
        if holding.is_set():
            finished_while_held.append(u.index)

    def held_write(out, journal):
        if journal.get("shards") and not held_once.is_set():
            held_once.set()
            holding.set()
            deadline = time.monotonic() + 5
            while len(finished_while_held) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            holding.clear()
        real_write(out, journal)
    monkeypatch.setattr(pp.Pipeline, "_run_unit", run_unit)
    monkeypatch.setattr(conversion, "_write_journal", held_write)
    out = porter.convert(tiny_vendor, tmp_path / "out", max_shard_size="300KB", progress=False, workers=1,
                         device="cpu")
    assert out["shards"] > 2 and len(finished_while_held) >= 3, finished_while_held

    def failing_write(out, journal):
        if journal.get("shards"):
            raise OSError(28, "No space left on device")
        real_write(out, journal)
    monkeypatch.setattr(conversion, "_write_journal", failing_write)
    with pytest.raises(Exception, match="No space left"):
        porter.convert(tiny_vendor, tmp_path / "full", max_shard_size="300KB", progress=False, workers=2,
                       device="cpu")
    assert not (tmp_path / "full" / "model.safetensors.index.json").exists()
