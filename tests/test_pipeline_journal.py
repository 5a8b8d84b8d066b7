"""The journal write of a finished shard (a file write with fsync) runs outside the shard writer's lock: another
thread can take that lock while it runs, so workers do not stall behind each shard's fsync."""

import threading

import porter
import porter.commands.convert as conversion
import porter.engine.run as pp


def test_journal_is_written_outside_the_pipeline_lock(tiny_vendor, tmp_path, monkeypatch):
    engines, free = [], []
    real_init, real_write = pp.Pipeline.__init__, conversion.write_journal

    def init(self, *args, **kwargs):
        engines.append(self)
        real_init(self, *args, **kwargs)

    def write(out, journal):
        if engines and journal.get("shards"):  # a shard's record (the first write, before any, has none)
            got = []

            def take():  # from another thread: can the writer's lock be had while the journal is written?
                got.append(engines[-1].writer.lock.acquire(timeout=2))
                if got[0]:
                    engines[-1].writer.lock.release()

            probe = threading.Thread(target=take)
            probe.start()
            probe.join()
            free.append(got[0])
        real_write(out, journal)

    monkeypatch.setattr(pp.Pipeline, "__init__", init)
    monkeypatch.setattr(conversion, "write_journal", write)
    out = porter.convert(
        tiny_vendor, tmp_path / "out", max_shard_size="300KB", progress=False, workers=3, device="cpu"
    )
    assert out["shards"] > 1 and len(free) == out["shards"], (out["shards"], free)
    assert all(free), free
