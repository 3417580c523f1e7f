"""`pip install .` gives a braid that imports and trains from any directory.

The wheel is built from the repo by scikit-build-core (pyproject.toml) with this Python's own
packages (--no-build-isolation: no network; scikit-build-core comes from
requirements-build.txt), CPU only, into a build folder of its own that later runs reuse
(build-pip/test-cpu, git-ignored). A cold build compiles braid's libraries (~4 min on 2 cores);
with ccache warm or the folder kept, seconds. The wheel is installed with --target into a
temporary folder, and a fresh interpreter imports braid from there, with the source tree off
its path and its working directory elsewhere.
"""

import importlib.util
import os
import subprocess
import sys
import textwrap
import zipfile

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
BUILD_DIR = "build-pip/test-cpu"

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("scikit_build_core") is None,
        reason="scikit-build-core is not installed (requirements-build.txt; scripts/bootstrap.sh)"),
    # The wheel is CPU-only and a cold build would take most of scripts/gpu_check.sh's budget.
    pytest.mark.skipif(os.environ.get("BRAID_TEST_DEVICE") == "cuda",
                       reason="packaging is checked by the CPU suite"),
]


def run(cmd, **kwargs):
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, (
        f"{' '.join(cmd)} exited {result.returncode}\n"
        f"--- stdout (tail)\n{result.stdout[-6000:]}\n--- stderr (tail)\n{result.stderr[-6000:]}")
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    run([sys.executable, "-m", "pip", "wheel", REPO, "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-w", str(out), f"-Cbuild-dir={BUILD_DIR}",
         "-Ccmake.define.BRAID_CUDA=OFF"], cwd=REPO)
    wheels = list(out.glob("braid-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_holds_the_package_and_one_extension(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "braid/__init__.py" in names
    extensions = [n for n in names if n.startswith("braid/_C") and n.endswith(".so")]
    assert len(extensions) == 1, extensions


def test_installed_braid_imports_and_trains_from_elsewhere(wheel, tmp_path):
    site = tmp_path / "site"
    run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
         "--disable-pip-version-check", "--target", str(site), str(wheel)])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = textwrap.dedent(f"""
        import os, sys
        import numpy as np
        import braid
        site = {str(site)!r}
        assert braid.__file__.startswith(site + os.sep), braid.__file__
        assert braid._C.__file__.startswith(site + os.sep), braid._C.__file__
        source = {os.path.join(REPO, "python")!r}
        assert not any(p.startswith(source) for p in sys.path), sys.path
        cfg = braid.TransformerConfig.preset("llama-tiny")
        model = braid.GPTModel(cfg, device="cpu", seed=1234)
        trainer = braid.Trainer(model, braid.AdamWConfig(lr=3e-4, weight_decay=0.1),
                                braid.LRSchedule(lr=3e-4, min_lr=3e-5, warmup_iters=1,
                                                 decay_iters=10))
        ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16), dtype=np.int32)
        stats = trainer.train_step(ids, np.roll(ids, -1, axis=1))
        assert np.isfinite(stats.loss) and stats.loss > 0, stats.loss
        print("version", braid.__version__, "loss", stats.loss)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    result = run([sys.executable, "-c", script], cwd=elsewhere, env=env)
    assert "version " in result.stdout
