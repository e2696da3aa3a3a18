"""scripts/install.py, the install behind `make run | test | bench`: what each path installs, how a
failed step reads, and that serving needs nothing from the test or bench extras."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def install():
    spec = importlib.util.spec_from_file_location("ember_install_script", os.path.join(ROOT, "scripts", "install.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_torch_is_always_the_cpu_pin(install):
    assert install.pinned(["torch>=2.5", "torchao>=0.1", "numpy"]) == [install.TORCH, "torchao>=0.1", "numpy"]
    assert install.TORCH == "torch==2.13.0"


def test_a_failed_step_names_itself_and_what_to_do(install, capsys):
    with pytest.raises(install.StepFailed) as e:
        install.step("the thing", [sys.executable, "-c", "raise SystemExit(3)"], "install the other thing first")
    message = str(e.value)
    assert "step 'the thing' failed (exit 3" in message and "install the other thing first" in message
    assert "the command was:" in message
    assert install.step("a fine thing", [sys.executable, "-c", "pass"], "unused") >= 0
    assert "a fine thing: done in" in capsys.readouterr().out


def test_the_main_command_reports_a_failure_without_a_traceback(tmp_path):
    # a venv path whose python cannot be created: the first step fails, named, exit 1
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "install.py"), "serve", "--venv", str(blocker / "venv")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    assert "ember install: FAILED: step 'create the virtual environment' failed" in out.stdout
    assert "Traceback" not in out.stdout


def test_serving_needs_no_test_or_bench_package():
    """`make run` installs the runtime dependencies only; what the server imports must be among them."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    runtime = " ".join(project["dependencies"]).lower()
    for extra_only in ("pytest", "transformers", "openai", "httpx", "llama-cpp-python", "lm-eval", "triton"):
        assert extra_only not in runtime
    # the CLI parses every subcommand's flags (ember serve too) with none of them importable
    code = (
        "import sys\n"
        "for name in ('httpx', 'transformers', 'openai', 'llama_cpp', 'triton', 'lm_eval', 'pytest'):\n"
        "    sys.modules[name] = None\n"
        "from ember.entrypoints.cli import build_parser\n"
        "build_parser().parse_args(['serve', '--help'])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--api-key" in out.stdout


def test_llama_cpp_is_built_without_amx_on_an_amx_cpu(install, monkeypatch):
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    monkeypatch.setattr(install, "cpu_flags", lambda: {"avx512f", "amx_int8", "amx_tile"})
    assert install.llama_cpp_build_env()["CMAKE_ARGS"] == install.LLAMA_CPP_NO_AMX
    monkeypatch.setattr(install, "cpu_flags", lambda: {"avx512f", "avx2"})
    assert "CMAKE_ARGS" not in install.llama_cpp_build_env()
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_BLAS=ON")
    monkeypatch.setattr(install, "cpu_flags", lambda: {"amx_int8"})
    assert install.llama_cpp_build_env()["CMAKE_ARGS"] == "-DGGML_BLAS=ON"  # the user's own stands
