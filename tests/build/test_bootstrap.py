"""`dsec image bootstrap debian`: a real Debian base from Debian's packages (mmdebstrap,
from a loopback mirror), runnable as a sandbox image."""

from __future__ import annotations

import pytest

from dsec.errors import InvalidArgument
from dsec.image.bootstrap import BootstrapPlan
from dsec.image.store import LayerStore
from tests.build.conftest import Debian

pytestmark = [pytest.mark.root, pytest.mark.slow]


def test_bootstrapped_debian_runs_python_and_pytest_in_a_sandbox(debian: Debian) -> None:
    m = LayerStore(debian.store_root).get(debian.image)
    assert m.kind == "base" and m.labels["dsec.io/bootstrap"] == "debian:bookworm:apt"
    assert m.labels["dsec.io/include"] == "python3,python3-pytest"
    assert "device nodes under /dev left out" in debian.bootstrap_output
    with debian.cluster.client() as c, c.sandboxes.create(image=debian.image) as sb:
        r = sb.exec("cat /etc/debian_version; python3 -c 'import sys; print(sys.version)';"
                    " python3 -m pytest --version; dpkg -s python3-pytest | head -2")
        assert r.exit_code == 0, r
        out, err = r.stdout.decode(), r.stderr.decode()
        assert out.splitlines()[0].startswith("12."), out
        assert "3.11" in out and "pytest 7" in out + err
        assert "Package: python3-pytest" in out


def test_bootstrap_plan_is_checked_and_argv_is_pure() -> None:
    p = BootstrapPlan.parse(suite="bookworm", include=" git,python3,git ",
                            mirror="http://127.0.0.1:1/", trusted=True)
    assert p.include == ("git", "python3")
    argv = p.argv("/t")
    assert argv[0] == "mmdebstrap" and "--include=git,python3" in argv
    assert argv[-3:] == ["bookworm", "/t", "deb [trusted=yes] http://127.0.0.1:1/ bookworm main"]
    keep = p.argv("/t", keep_debs_in="/k")
    assert "--skip=essential/unlink" in keep
    assert any(a.endswith("/var/cache/apt/archives /k") for a in keep)
    # the cache key is the package set, not the mirror
    assert p.key() == BootstrapPlan.parse(suite="bookworm", include="python3,git").key()
    assert p.key() != BootstrapPlan.parse(suite="trixie", include="python3,git").key()
    for bad in ({"suite": "Bookworm;rm"}, {"suite": "bookworm", "include": "py thon"},
                {"suite": "bookworm", "variant": "fat"},
                {"suite": "bookworm", "mirror": "ftp://x"}):
        with pytest.raises(InvalidArgument):
            BootstrapPlan.parse(**bad)  # type: ignore[arg-type]
