"""vm/density.py: the QEMU/guest-kernel pieces for VM density, and the padded pmem clone
of a layer (real files: holes, reflink or copy, concurrent callers)."""

from __future__ import annotations

import os
import threading

import pytest

from dsec.edge.backends.vm import density as d
from dsec.errors import InvalidArgument, SandboxError

MIB = 1 << 20


def test_pmem_bytes_rounds_up_to_2mib() -> None:
    assert d.pmem_bytes(1) == 2 * MIB
    assert d.pmem_bytes(2 * MIB) == 2 * MIB
    assert d.pmem_bytes(95166464) == 96468992  # the 91 MiB layer of the experiments
    with pytest.raises(InvalidArgument, match="empty"):
        d.pmem_bytes(0)


def test_qemu_args_default_has_every_mechanism() -> None:
    opts = d.DensityOptions()
    pm = [d.PmemLayer("/l/a,b.erofs", 4 * MIB), d.PmemLayer("/l/c", 2 * MIB)]
    args = d.qemu_args(opts, pm, ram_bytes=512 * MIB)
    assert d.accel_args(opts) == ["-accel", "tcg,tb-size=32"]
    assert args[:2] == ["-m", "512M,slots=2,maxmem=518M"]
    objs = [args[i + 1] for i, a in enumerate(args) if a == "-object"]
    devs = [args[i + 1] for i, a in enumerate(args) if a == "-device"]
    # a comma in a path must not start a new QEMU option
    assert objs[0] == ("memory-backend-file,id=dsec-pm0,mem-path=/l/a,,b.erofs,size=4194304,"
                       "share=on,readonly=on,dump=off")
    assert "readonly=on" in objs[1] and "share=on" in objs[1]
    assert devs == ["virtio-pmem-pci,memdev=dsec-pm0,id=dsec-vpm0",
                    "virtio-pmem-pci,memdev=dsec-pm1,id=dsec-vpm1",
                    "virtio-balloon-pci,id=dsec-balloon,free-page-reporting=on,deflate-on-oom=on"]
    assert d.memory_arg(512 * MIB, pm) == "512M,slots=2,maxmem=518M"
    assert d.guest_layer_devices(opts, 2) == ["/dev/pmem0", "/dev/pmem1"]
    assert d.guest_struct_page_bytes(pm) == 6 * MIB // 64


def test_everything_off_is_plain_tcg() -> None:
    opts = d.DensityOptions(pmem_dax=False, free_page_reporting=False, deflate_on_oom=False,
                            damon_reclaim=False, tb_size_mib=None)
    assert d.accel_args(opts) == ["-accel", "tcg"]
    assert d.qemu_args(opts, ram_bytes=256 * MIB) == []
    assert d.kernel_cmdline(opts) == []
    assert d.memory_arg(256 * MIB, []) == "256M"
    assert d.guest_layer_devices(opts, 2, first_blk=1) == ["/dev/vdb", "/dev/vdc"]
    with pytest.raises(InvalidArgument, match="pmem_dax is off"):
        d.device_args(opts, [d.PmemLayer("/x", 2 * MIB)])


def test_kernel_cmdline_damon_always_on_with_wide_intervals() -> None:
    assert d.kernel_cmdline(d.DensityOptions()) == ["swiotlb=noforce"]  # DAMON off by default
    assert d.kernel_cmdline(d.DensityOptions(page_reporting_order=0)) == [
        "swiotlb=noforce", "page_reporting.page_reporting_order=0"]
    cmd = d.kernel_cmdline(d.DensityOptions(damon_reclaim=True, damon_min_age_s=5,
                                            damon_sample_ms=100, damon_aggr_ms=2000))
    assert "damon_reclaim.enabled=Y" in cmd
    assert "damon_reclaim.min_age=5000000" in cmd
    assert "damon_reclaim.sample_interval=100000" in cmd
    assert "damon_reclaim.aggr_interval=2000000" in cmd
    # the kernel's default watermarks (500/400/200) reclaim only under 40% free memory
    assert cmd[0] == "swiotlb=noforce"   # pmem above 4 GiB: no 64 MiB bounce buffer
    assert {"damon_reclaim.wmarks_high=1000", "damon_reclaim.wmarks_mid=999",
            "damon_reclaim.wmarks_low=0"} <= set(cmd)


@pytest.mark.parametrize("kw, match", [
    ({"tb_size_mib": 0}, "tb_size_mib"),
    ({"damon_min_age_s": 0}, "damon_min_age_s"),
    ({"damon_sample_ms": 500, "damon_aggr_ms": 100}, "sample <= aggregation"),
    ({"damon_quota_bytes_per_s": 1000}, "1 MiB/s"),
    ({"page_reporting_order": 11}, "page order"),
])
def test_options_refuse_nonsense(kw: dict[str, float], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        d.DensityOptions(**kw)  # type: ignore[arg-type]


def test_hostile_paths_and_sizes_refused() -> None:
    with pytest.raises(InvalidArgument, match="newline"):
        d.device_args(d.DensityOptions(), [d.PmemLayer("/a\nb", 2 * MIB)])
    with pytest.raises(InvalidArgument, match="multiple"):
        d.device_args(d.DensityOptions(), [d.PmemLayer("/a", 3 * MIB)])
    with pytest.raises(InvalidArgument, match="whole number of MiB"):
        d.memory_arg(100 * MIB + 1, [])


def test_prepare_pmem_layer_pads_once_with_a_hole(tmp_path: os.PathLike[str]) -> None:
    layer = os.path.join(tmp_path, "sha256-abc.erofs")
    data = os.urandom(3 * MIB + 4096)
    with open(layer, "wb") as f:
        f.write(data)
    cache = os.path.join(tmp_path, "pmem")
    p = d.prepare_pmem_layer(layer, cache)
    assert p.size == 4 * MIB == os.path.getsize(p.path)
    assert os.path.dirname(p.path) == cache
    with open(p.path, "rb") as f:
        assert f.read(len(data)) == data
        assert f.read() == b"\0" * (4 * MIB - len(data))
    assert os.stat(p.path).st_mode & 0o777 == 0o444
    assert os.stat(p.path).st_blocks * 512 < 4 * MIB  # the padding is a hole
    ino = os.stat(p.path).st_ino
    assert d.prepare_pmem_layer(layer, cache) == p and os.stat(p.path).st_ino == ino
    # a rebuilt layer (new mtime) never reuses the old clone
    os.utime(layer, ns=(1, 1))
    assert d.prepare_pmem_layer(layer, cache).path != p.path
    assert not [n for n in os.listdir(cache) if ".tmp." in n]


def test_prepare_pmem_layer_aligned_file_used_as_is(tmp_path: os.PathLike[str]) -> None:
    layer = os.path.join(tmp_path, "l.erofs")
    with open(layer, "wb") as f:
        f.truncate(2 * MIB)
    os.chmod(layer, 0o644)
    assert d.prepare_pmem_layer(layer, os.path.join(tmp_path, "c")) == d.PmemLayer(layer, 2 * MIB)
    assert not os.path.exists(os.path.join(tmp_path, "c"))
    # QEMU (an unprivileged uid) reopens the region by path: a 0600 layer gets a clone
    os.chmod(layer, 0o600)
    p = d.prepare_pmem_layer(layer, os.path.join(tmp_path, "c"))
    assert p.path != layer and os.stat(p.path).st_mode & 0o777 == 0o444


def test_prepare_pmem_layer_concurrent_callers_agree(tmp_path: os.PathLike[str]) -> None:
    layer = os.path.join(tmp_path, "l.erofs")
    with open(layer, "wb") as f:
        f.write(os.urandom(MIB))
    cache = os.path.join(tmp_path, "c")
    out: list[d.PmemLayer] = []
    ts = [threading.Thread(target=lambda: out.append(d.prepare_pmem_layer(layer, cache)))
          for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(out) == 4 and len(set(out)) == 1 and os.path.getsize(out[0].path) == 2 * MIB


def test_prepare_pmem_layer_errors_say_what(tmp_path: os.PathLike[str]) -> None:
    with pytest.raises(SandboxError, match="cannot be used as a pmem region"):
        d.prepare_pmem_layer(os.path.join(tmp_path, "missing"), str(tmp_path))
    layer = os.path.join(tmp_path, "l.erofs")
    with open(layer, "wb") as f:
        f.write(b"x" * 5000)
    blocker = os.path.join(tmp_path, "file-not-dir")
    open(blocker, "w").close()
    with pytest.raises((SandboxError, OSError)):
        d.prepare_pmem_layer(layer, blocker)
