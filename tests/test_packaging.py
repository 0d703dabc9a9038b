"""gptserve installs as one top-level package, `gptserve`, beside transformers and Hugging Face's
`kernels` package, and runs from any folder, whatever that folder holds."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch

import gptserve
from tests.server.conftest import free_port, wait_for_server

REPO = Path(__file__).resolve().parents[1]
PARTS = ("model", "kernels", "engine", "server", "training")
# files a user's folder may hold: each would stop a process that imported it
SHADOWS = ("model.py", "train.py", "engine.py", "kernels/__init__.py", "server/__init__.py")


def shadowed_folder(root: Path) -> Path:
    """An empty folder with its own model.py, train.py, kernels/, server/ and engine.py."""
    root.mkdir(parents=True, exist_ok=True)
    for name in SHADOWS:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"raise SystemExit('the folder\\'s own {name} was imported')\n")
    return root


@contextmanager
def serving(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> Iterator[str]:
    """Run a server command; yield its URL once /health is 200; stop it after. Its log is in
    the context's `log` attribute once stopped (read by the caller from the process)."""
    port = free_port()
    proc = subprocess.Popen(
        [*cmd, "--port", str(port)], cwd=cwd, env=env, text=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(url, proc, timeout=timeout)
        yield url
    finally:
        proc.terminate()
        serving.log = proc.communicate(timeout=60)[1]


serving.log = ""


def complete(url: str) -> str:
    body = {"prompt": "To be", "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_transformers_and_gptserve_in_one_process(tmp_path: Path) -> None:
    """Hugging Face's `kernels` (transformers' dependency) is the one `import kernels` finds, and
    a transformers model and a gptserve engine run side by side: the same greedy tokens."""
    from gptserve.engine.engine import Engine, EngineConfig
    from gptserve.engine.loader import load_for_inference
    from gptserve.engine.sampler import SamplingParams
    from transformers import GPT2Config, GPT2LMHeadModel

    import kernels

    assert Path(kernels.__file__).resolve() != REPO / "kernels" / "__init__.py"
    assert hasattr(kernels, "get_kernel")  # Hugging Face's, which transformers imports
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=50257)
    hf = GPT2LMHeadModel(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    prompt = [464, 2068, 7586]
    with torch.no_grad():
        hf_tokens = hf.generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
    loaded = load_for_inference(tmp_path / "hf", device="cpu", dtype="float32")
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig())
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    tokens: list[int] = []
    while engine.has_work():
        for out in engine.step():
            tokens.extend(out.token_ids)
    assert tokens == hf_tokens


@pytest.mark.parametrize("how", ["gptserve serve", "python -m gptserve.server"])
def test_serve_from_a_folder_that_shadows_every_part(
    how: str, tmp_path: Path, tiny_checkpoint: Path
) -> None:
    command = Path(sys.executable).with_name("gptserve")
    cmd = (
        [str(command), "serve"]
        if how == "gptserve serve"
        else [sys.executable, "-m", "gptserve.server"]
    )
    folder = shadowed_folder(tmp_path / "work")
    with serving([*cmd, "--model", str(tiny_checkpoint)], folder, dict(os.environ), 120) as url:
        assert isinstance(complete(url), str)


def test_every_command_has_help() -> None:
    command = str(Path(sys.executable).with_name("gptserve"))
    top = subprocess.run([command, "--help"], capture_output=True, text=True, timeout=60)
    assert top.returncode == 0, top.stderr
    for name in ("serve", "generate", "train", "ray", "fetch", "export"):
        assert f"  {name}" in top.stdout
        done = subprocess.run(
            [command, name, "--help"], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"usage: gptserve {name}"), done.stdout[:200]
    wrong = subprocess.run([command, "nope"], capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and wrong.stderr.startswith("error: unknown command 'nope'")


def source_files() -> set[str]:
    """Every file the wheel must carry, as its path in the wheel."""
    wanted = {f"gptserve/{p.name}" for p in (REPO / "gptserve").glob("*.py")}
    for part in PARTS:
        for path in (REPO / part).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                wanted.add(f"gptserve/{path.relative_to(REPO).as_posix()}")
    return wanted


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(REPO)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = out.glob("gptserve-*.whl")
    return path


def test_the_wheel_holds_gptserve_only_and_all_of_it(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        dist_info = f"gptserve-{gptserve.__version__}.dist-info"
        record = archive.read(f"{dist_info}/RECORD").decode()
        scripts = archive.read(f"{dist_info}/entry_points.txt").decode()
    assert {name.split("/")[0] for name in names} == {"gptserve", dist_info}
    assert {line.split(",")[0].split("/")[0] for line in record.splitlines()} == {
        "gptserve", dist_info,
    }  # fmt: skip
    missing = source_files() - names
    assert not missing, f"the wheel lacks {sorted(missing)[:10]}"
    for needed in ("kernels/cpu/llama_layer.cpp", "model/shakespeare/model.safetensors",
                   "server/static/index.html"):  # fmt: skip
        assert f"gptserve/{needed}" in names
    assert "gptserve = gptserve.cli:main" in scripts


def fresh_venv(root: Path) -> Path:
    """A new virtual environment whose own site-packages holds nothing, with this environment's
    packages (transformers and Hugging Face's `kernels` among them) reachable behind it, except
    gptserve's own install: its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    site = Path(subprocess.check_output(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    ).strip())  # fmt: skip
    deps = root / "deps"  # this environment's packages, gptserve's editable install left out
    deps.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if "gptserve" not in entry.name and not entry.name.endswith(".pth"):
            (deps / entry.name).symlink_to(entry)
    (site / "deps.pth").write_text(f"{deps}\n")
    return python


def test_the_image_steps_install_the_wheel_and_start_ready(tmp_path: Path) -> None:
    """deploy/docker/install.sh, as the Dockerfile runs it, into a fresh environment that already
    has transformers and Hugging Face's `kernels`: only gptserve lands in site-packages, both
    packages import, and `gptserve serve` of the default model, from a folder that shadows every
    part, loads the prebuilt kernels and the fetched model: nothing is compiled or downloaded."""
    python = fresh_venv(tmp_path / "venv")
    extensions = tmp_path / "extensions"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "PYTHON": str(python)}
    env.pop("GPTSERVE_NATIVE_ARCH", None)
    env["KERNEL_TARGETS"] = "x86-64-v3"  # the baseline every host here runs
    done = subprocess.run(
        ["bash", str(REPO / "deploy" / "docker" / "install.sh")], env=env, capture_output=True,
        text=True, timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]

    site = python.parents[1] / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    top = {p.name for p in (site / "site-packages").iterdir()} - {"deps.pth", "__pycache__"}
    assert top == {"gptserve", f"gptserve-{gptserve.__version__}.dist-info"}, top

    both = subprocess.run(
        [str(python), "-c", "import kernels, transformers, gptserve.kernels, gptserve.model.gpt;"
         "print(kernels.__file__); print(gptserve.kernels.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,  # `-c` puts the cwd first
    )  # fmt: skip
    assert both.returncode == 0, both.stderr[-3000:]
    hub, ours = both.stdout.split()
    assert "deps" in hub and str(site) in ours, both.stdout

    serve_env = {k: v for k, v in env.items() if k != "PYTHON"}
    folder = shadowed_folder(tmp_path / "work")
    with serving([str(python.with_name("gptserve")), "serve"], folder, serve_env, 300) as url:
        assert isinstance(complete(url), str)
    assert "prebuilt -march=x86-64-v3" in serving.log, serving.log[-3000:]
    assert "compiling" not in serving.log and "fetching" not in serving.log, serving.log[-3000:]


def test_python_train_py_from_the_root_does_not_shadow_hugging_faces_kernels() -> None:
    """A script's own folder heads sys.path: train.py drops the root before importing, so the
    root's kernels/ never stands in for Hugging Face's `kernels` there."""
    probe = (
        "import runpy, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})  # as `python train.py` from the root has it\n"
        f"runpy.run_path({str(REPO / 'train.py')!r}, run_name='probe')\n"
        "import kernels, transformers\n"
        "print(kernels.__file__)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert Path(done.stdout.strip()).resolve() != REPO / "kernels" / "__init__.py", done.stdout
    helped = subprocess.run([sys.executable, str(REPO / "train.py"), "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert helped.returncode == 0 and helped.stdout.startswith("usage: gptserve train")
