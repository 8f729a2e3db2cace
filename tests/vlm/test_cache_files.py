"""Cache files survive a kill mid-write: written atomically, and a torn or damaged one is
recomputed with a warning naming it, never fatal and never used half."""

import torch

from vlm.features import read_cache, write_cache


def test_a_cache_is_written_whole_and_a_torn_one_reads_as_absent(tmp_path, caplog):
    path = tmp_path / "vision-features.pt"
    features = {"image-1": torch.randn(4, 8), "image-2": torch.randn(4, 8)}
    write_cache(features, path)
    assert list(tmp_path.iterdir()) == [path]  # nothing left beside it
    assert torch.equal(read_cache(path)["image-2"], features["image-2"])
    whole = path.read_bytes()
    for torn in (whole[: len(whole) // 2], whole[:10], b"", b"\x00" * 64):
        path.write_bytes(torn)
        caplog.clear()
        assert read_cache(path) is None
        assert f"cache {path} is unreadable" in caplog.text
    assert read_cache(tmp_path / "absent.pt") is None
