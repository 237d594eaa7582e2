"""Host memory from CUDA's virtual memory API against the pinned store's registered mmap.

Run on a CUDA machine from the repository root (needs the largest size in pinnable RAM)::

    python notebooks/probes/vmm_host.py OUT.json [GB ...]      # default: 16 64

Prediction: ``cuMemCreate`` with a host location (2 MiB granularity) might let the GPU map
the table with 2 MiB pages instead of the 4 KiB pages of a ``cudaHostRegister``-ed mmap,
so sparse gathers and scatters from huge tables would need far fewer translations. For
each size, a float32 table of 512 B rows is built both ways (the VMM one mapped for the
GPU only) and timed with the library's kernels (random ids: ``kernel`` unsorted;
``sorted_*`` ids sorted with ``pos``, default grid / ``ordered`` rule / one block per SM
with 2-byte vectors; torch ``index_select`` of the sorted ids; scatter of the distinct
ids). Figures are medians of 7 CUDA-event timings (ms). Session 11's results:
``notebooks/results/h200-vmm-host-session11.json`` (DESIGN.md, "Ideas measured and
rejected").
"""

# ruff: noqa: B023  (each timed lambda runs inside its loop iteration)
from __future__ import annotations

import _gpu_only  # noqa: F401  (exits on a machine without CUDA, before anything else)

import ctypes as ct
import json
import sys
import time

import numpy as np
import torch

import gadgetloader as gl
from gadgetloader.transfer import _kernels as kernels

cu = ct.CDLL("libcuda.so.1")


class Loc(ct.Structure):
    _fields_ = [("type", ct.c_int), ("id", ct.c_int)]


class AllocFlags(ct.Structure):
    _fields_ = [
        ("compressionType", ct.c_ubyte),
        ("gpuDirectRDMACapable", ct.c_ubyte),
        ("usage", ct.c_ushort),
        ("reserved", ct.c_ubyte * 4),
    ]


class Prop(ct.Structure):
    _fields_ = [
        ("type", ct.c_int),
        ("requestedHandleTypes", ct.c_int),
        ("location", Loc),
        ("win32HandleMetaData", ct.c_void_p),
        ("allocFlags", AllocFlags),
    ]


class Access(ct.Structure):
    _fields_ = [("location", Loc), ("flags", ct.c_ulonglong)]


def ck(r: int, what: str) -> None:
    if r != 0:
        name = ct.c_char_p()
        cu.cuGetErrorName(r, ct.byref(name))
        raise RuntimeError(f"{what}: {r} {name.value}")


LOC_DEVICE, LOC_HOST, LOC_HOST_NUMA = 1, 2, 3
#: also map the VMM table for the CPU: on the H200 VM, cuMemSetAccess with a HOST_NUMA
#: location returned CUDA_ERROR_INVALID_VALUE, so the probe maps it for the GPU only
CPU_ACCESS = False


class VmmHost:
    def __init__(self, nbytes: int, loc_type: int, gran_kind: int = 1):
        p = Prop()
        p.type = 1  # pinned
        p.location.type = loc_type
        p.location.id = 0
        g = ct.c_size_t()
        ck(cu.cuMemGetAllocationGranularity(ct.byref(g), ct.byref(p), gran_kind), "granularity")
        self.gran = g.value
        size = -(-nbytes // self.gran) * self.gran
        self.size = size
        h = ct.c_ulonglong()
        t = time.time()
        ck(cu.cuMemCreate(ct.byref(h), ct.c_size_t(size), ct.byref(p), ct.c_ulonglong(0)), "create")
        self.h = h
        ptr = ct.c_ulonglong()
        ck(
            cu.cuMemAddressReserve(
                ct.byref(ptr),
                ct.c_size_t(size),
                ct.c_size_t(self.gran),
                ct.c_ulonglong(0),
                ct.c_ulonglong(0),
            ),
            "reserve",
        )
        self.ptr = ptr.value
        ck(
            cu.cuMemMap(
                ct.c_ulonglong(self.ptr), ct.c_size_t(size), ct.c_size_t(0), h, ct.c_ulonglong(0)
            ),
            "map",
        )
        descs = (Access * 2)()
        descs[0].location.type = LOC_DEVICE
        descs[0].location.id = 0
        descs[0].flags = 3
        n = 1
        if CPU_ACCESS:
            descs[1].location.type = LOC_HOST_NUMA
            descs[1].location.id = 0
            descs[1].flags = 3
            n = 2
        ck(
            cu.cuMemSetAccess(ct.c_ulonglong(self.ptr), ct.c_size_t(size), descs, ct.c_size_t(n)),
            "access",
        )
        self.setup_s = time.time() - t

    def tensor(self, shape: tuple[int, ...]) -> torch.Tensor:
        import cupy as cp

        mem = cp.cuda.UnownedMemory(self.ptr, self.size, self)
        arr = cp.ndarray(shape, dtype=cp.float32, memptr=cp.cuda.MemoryPointer(mem, 0))
        return torch.as_tensor(arr, device="cuda")

    def close(self) -> None:
        ck(cu.cuMemUnmap(ct.c_ulonglong(self.ptr), ct.c_size_t(self.size)), "unmap")
        ck(cu.cuMemRelease(self.h), "release")
        ck(cu.cuMemAddressFree(ct.c_ulonglong(self.ptr), ct.c_size_t(self.size)), "free")


def timed(fn, reps: int = 7) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return round(float(np.median(ts)), 3)


def measure(table: torch.Tensor, tag: str) -> dict:
    rows, width = table.shape
    res = {}
    for n in (131072, 1 << 20):
        g = torch.Generator(device="cuda").manual_seed(n)
        ids = torch.randint(0, rows, (n,), device="cuda", generator=g)
        sids, perm = torch.sort(ids)
        distinct = torch.unique(ids)
        out = torch.empty(n, width, device="cuda")
        src = torch.randn(distinct.numel(), width, device="cuda")
        r = {
            "g_kernel": timed(lambda: kernels.launch_gather(table, ids, out)),
            "g_sorted_default": timed(lambda: kernels.launch_gather(table, sids, out, pos=perm)),
            "g_sorted_rule": timed(
                lambda: kernels.launch_gather(table, sids, out, pos=perm, ordered=True)
            ),
            "g_sorted_b1v2": timed(
                lambda: kernels.launch_gather(
                    table, sids, out, pos=perm, blocks_per_sm=1, max_vector=2
                )
            ),
            "g_torch_sorted": timed(lambda: torch.index_select(table, 0, sids, out=out)),
            "s_sorted_default": timed(lambda: kernels.launch_scatter(table, distinct, src)),
            "s_sorted_rule": timed(
                lambda: kernels.launch_scatter(table, distinct, src, ordered=True)
            ),
        }
        kernels.launch_gather(table, sids, out, pos=perm, ordered=True)
        ref = torch.index_select(table, 0, ids)
        r["same"] = bool(torch.equal(out, ref))
        r["memcpy_ms"] = round(n * width * 4 / 55.0e6, 3)
        res[str(n)] = r
        print(tag, n, r, flush=True)
    return res


def main() -> None:
    out_path = sys.argv[1]
    sizes = [int(a) for a in sys.argv[2:]] or [16, 64]
    torch.zeros(1, device="cuda")
    results: dict = {}
    for loc_name, loc in (("host_numa", LOC_HOST_NUMA), ("host", LOC_HOST)):
        for kind in (0, 1):
            p = Prop()
            p.type = 1
            p.location.type = loc
            g = ct.c_size_t()
            r = cu.cuMemGetAllocationGranularity(ct.byref(g), ct.byref(p), kind)
            results[f"gran_{loc_name}_{kind}"] = [r, g.value]
    print(results, flush=True)
    for gb in sizes:
        nbytes = gb << 30
        width = 128
        shape = (nbytes // (width * 4), width)
        for loc_name, loc in (("host_numa", LOC_HOST_NUMA), ("host", LOC_HOST)):
            try:
                v = VmmHost(nbytes, loc)
            except Exception as e:  # noqa: BLE001
                results[f"{gb}GB_vmm_{loc_name}"] = {"error": str(e)}
                print(gb, loc_name, "error", e, flush=True)
                continue
            t = v.tensor(shape)
            t.view(-1)[:: 1 << 18].normal_()
            torch.cuda.synchronize()
            r = measure(t, f"{gb}GB vmm {loc_name}")
            r.update(setup_s=round(v.setup_s, 1), gran=v.gran)
            results[f"{gb}GB_vmm_{loc_name}"] = r
            del t
            torch.cuda.synchronize()
            v.close()
            break  # one VMM kind per size is enough once it works
        t0 = time.time()
        gad = gl.DataGadget(shape, dtype="float32", placement="pinned")
        tab = gad.as_tensor()
        setup = time.time() - t0
        r = measure(tab, f"{gb}GB registered")
        r.update(setup_s=round(setup, 1))
        results[f"{gb}GB_registered"] = r
        del tab
        gad.close()
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
