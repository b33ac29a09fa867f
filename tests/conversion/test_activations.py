"""The calibration activation store: memory and disk backing, float32 and bfloat16, resume bytes."""

from __future__ import annotations

import pytest
import torch

from quantkit.conversion.activations import ActivationStore, LayerRouting, StoreRows
from quantkit.planner.cost import StorePlan


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


@pytest.mark.parametrize("backing", ["memory", "disk"])
def test_store_rows_are_the_layers_rows_in_token_order(tmp_path, backing):
    """StoreRows, what a method sees of a layer (quantkit.quant.rows.LayerRows): its micro-batches are the
    store's x and the routing's slices, starting at their first token; gathered, the whole x; routed,
    each expert's token indices."""
    n, t, d, k, e = 5, 3, 4, 2, 4
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, t, d, generator=g)
    idx = torch.stack([torch.arange(n * t) % e, (torch.arange(n * t) + 1) % e], -1)  # (n t, k)
    wt = torch.rand(n * t, k, generator=g)
    store = ActivationStore(n, t, d, StorePlan(backing=backing, micro_batch=2), "cpu", tmp_path)
    for sl in store.slices():
        store.open_x().write(sl, x[sl])
    cuts = [0, 2 * t, 4 * t, n * t]  # the micro-batches' tokens
    routing = LayerRouting([idx[a:b] for a, b in zip(cuts, cuts[1:])], [wt[a:b] for a, b in zip(cuts, cuts[1:])],
                           [b - a for a, b in zip(cuts, cuts[1:])], e)
    rows = StoreRows(store, routing)
    assert (rows.tokens, rows.seq_len, rows.probe) == (n * t, t, None)
    assert rows.counts.tolist() == [int((idx == j).sum()) for j in range(e)]
    batches = list(rows.batches())
    assert [b.start for b in batches] == cuts[:-1]
    assert torch.equal(torch.cat([b.x for b in batches]), x.reshape(-1, d)) and torch.equal(rows.gather(), x.reshape(-1, d))
    assert torch.equal(torch.cat([b.idx for b in batches]), idx) and torch.equal(torch.cat([b.weight for b in batches]), wt)
    routed = rows.routed([1, 3])
    assert routed[1].tolist() == [i for i in range(n * t) if 1 in idx[i].tolist()] and set(routed) == {1, 3}
    store.close()
