"""The calibration activation store: memory and disk backing, float32 and bfloat16, resume bytes."""

from __future__ import annotations

import pytest
import torch

from quantkit.conversion.activations import ActivationStore, StorePlan


@pytest.mark.parametrize("backing", ["memory", "disk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_round_trips_micro_batches(tmp_path, backing, dtype):
    h = torch.randn(5, 3, 8, generator=torch.Generator().manual_seed(0))
    store = ActivationStore(5, 3, 8, StorePlan(dtype=dtype, backing=backing, micro_batch=2), "cpu", tmp_path)
    assert [(s.start, s.stop) for s in store.slices()] == [(0, 2), (2, 4), (4, 5)]
    store.h.assign(h, 2)
    got = torch.cat([store.h.read(sl) for sl in store.slices()])
    assert got.dtype == torch.float32 and got.shape == h.shape
    assert torch.equal(got, h.to(dtype).float())  # exactly the stored rounding, nothing else
    # a write to one micro-batch touches only it
    store.h.write(slice(2, 4), torch.zeros(2, 3, 8))
    assert torch.equal(store.h.read(slice(0, 2)), h[:2].to(dtype).float())
    assert store.h.read(slice(2, 4)).abs().sum() == 0
    store.close()
    assert not list(tmp_path.glob("*.work"))  # disk backing leaves no file behind


def test_disk_backing_is_not_resident(tmp_path):
    """Disk-backed arrays live in files (pread/pwrite), not in a tensor of our process."""
    store = ActivationStore(4, 2, 4, StorePlan(backing="disk", micro_batch=4), "cpu", tmp_path)
    assert not hasattr(store.h, "data")
    assert (tmp_path / "h.work").stat().st_size == 4 * 2 * 4 * 4
    store.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resume_state_is_one_copy_in_stored_dtype(tmp_path, dtype):
    h = torch.randn(3, 2, 4, generator=torch.Generator().manual_seed(1))
    a = ActivationStore(3, 2, 4, StorePlan(dtype=dtype, micro_batch=2), "cpu", tmp_path)
    a.h.assign(h, 2)
    a.h.save(tmp_path / "hidden.bin")
    assert (tmp_path / "hidden.bin").stat().st_size == h.numel() * torch.empty(0, dtype=dtype).element_size()
    b = ActivationStore(3, 2, 4, StorePlan(dtype=dtype, backing="disk", micro_batch=1), "cpu", tmp_path / "..")
    b.h.load(tmp_path / "hidden.bin")
    assert torch.equal(b.h.read(slice(0, 3)), a.h.read(slice(0, 3)))
    a.close()
    b.close()
