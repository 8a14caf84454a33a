"""Every code block in the README and docs/ runs, so the docs cannot rot.

Per document, in order: a YAML block is validated with load_config (and saved as config.yaml
for the Python blocks after it); Python blocks run in one namespace, in a scratch folder; every
```sh``` block runs in bash (:func:`test_shell_blocks_with_the_cli_run`). A block fenced
```python notest``` or ```sh notest``` is a fragment shown, not a program (a DeepSpeed loop's
lines, a backend's registration, a SLURM script, `make test` itself): it is the one kind not
run, and says so where it stands; every other shell fence is refused
(:func:`test_every_shell_block_runs_or_says_it_is_a_fragment`).
"""

from __future__ import annotations

import getpass
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import areal_ckpt as ac

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.DOTALL | re.MULTILINE)


def blocks(doc: Path) -> list[tuple[str, str]]:
    return [(match.group(1), match.group(2)) for match in BLOCK.finditer(doc.read_text())]


@pytest.mark.parametrize("doc", DOCS, ids=[doc.name for doc in DOCS])
def test_code_blocks_run(doc, tmp_path, monkeypatch, request):
    monkeypatch.chdir(tmp_path)
    if any(language == "python" and "s3://" in code for language, code in blocks(doc)):
        server = request.getfixturevalue("s3_server")  # the real S3 server the doc's examples write to
        for variable, value in server.environment().items():
            monkeypatch.setenv(variable, value)
        if "ckpt" not in {bucket["Name"] for bucket in server.client().list_buckets()["Buckets"]}:
            server.make_bucket("ckpt")
    namespace: dict = {"__name__": f"doc_{doc.stem}"}
    for language, code in blocks(doc):
        if language == "yaml" and re.search(r"^(saver|recover):", code, re.MULTILINE):
            (tmp_path / "config.yaml").write_text(code)
            ac.load_config(tmp_path / "config.yaml")
        elif language == "python":
            exec(compile(code, f"{doc.name}:python-block", "exec"), namespace)


def test_shell_blocks_with_the_cli_run(tmp_path, tokenizer):
    """Every ```sh``` block runs as written, in the folder `make demo` runs in, against a trial
    where the demo leaves one (an actor and a frozen ref) and a DeepSpeed save_dir where the
    pages put one (`runs/ds_ckpt`, ours, and `runs/ds_native`, DeepSpeed's own), with neither
    USER nor LOGNAME set (as in many containers)."""
    from distributed import run_distributed
    from recover_fixtures import SPEC, make_setup, step_info
    from test_deepspeed import deepspeed_checkpoints_worker

    run_distributed(deepspeed_checkpoints_worker, 1, str(tmp_path / "deepspeed"), 2)
    (tmp_path / "runs").mkdir()
    (tmp_path / "deepspeed/ours").rename(tmp_path / "runs/ds_ckpt")
    (tmp_path / "deepspeed/native").rename(tmp_path / "runs/ds_native")

    setup = make_setup()
    engines = {"actor": setup.engine, "ref": ac.TorchEngine(make_setup(seed=2).model)}
    config = ac.RecoverConfig(
        experiment_name="grpo-digits", trial_name="trial0", fileroot=str(tmp_path / "runs"), mode="on",
        user=getpass.getuser(),  # as the demo's own process finds it without USER
    )  # fmt: skip
    handler = ac.RecoverHandler(config, SPEC)
    handler.dump(engines, step_info(0), tokenizer=tokenizer, force=True)
    handler.close()
    env = {name: value for name, value in os.environ.items() if name not in ("USER", "LOGNAME")}
    azurite = Path(sys.executable).parent.parent / "azurite/node_modules/.bin"  # where `make test` installs it
    env["PATH"] = f"{Path(sys.executable).parent}:{azurite}:{os.environ['PATH']}"
    shell = [code for doc in DOCS for language, code in blocks(doc) if language == "sh"]
    assert shell
    for code in shell:
        done = subprocess.run(
            ["bash", "-euc", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
    assert (tmp_path / "exported/config.json").is_file()


FENCE = re.compile(r"^```([^\n`]*)\n", re.MULTILINE)


def test_every_shell_block_runs_or_says_it_is_a_fragment():
    """A shell block is either ```sh``` (run by the suite as written) or ```sh notest```; a
    ```console```, ```bash``` or ```shell``` block would be neither, and could drift unseen."""
    for doc in DOCS:
        infos = FENCE.findall(doc.read_text())[::2]  # each block's opening fence, not its closing one
        shells = [info for info in infos if info.split(" ")[0] in ("sh", "shell", "bash", "console", "zsh")]
        assert set(shells) <= {"sh", "sh notest"}, (doc.name, shells)


def test_readme_shows_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert "make demo" in text and "make test" in text


@pytest.mark.parametrize("doc", ["README.md", "docs/quickstart.md"])
def test_the_loop_resumes_when_run_twice(doc, tmp_path, monkeypatch):
    """The page says a restarted job resumes by itself: its loop, run twice in one folder (as a
    user reruns it), is resumed the second time (a temporary folder per run never was)."""
    monkeypatch.chdir(tmp_path)
    (code,) = [code for language, code in blocks(ROOT / doc) if language == "python" and "recover.load(" in code]
    runs = []
    for _ in range(2):
        namespace: dict = {"__name__": "doc_loop"}
        exec(compile(code, f"{doc}:python-block", "exec"), namespace)
        runs.append(namespace["info"])
    assert runs[0] is None and runs[1] is not None and runs[1].last_step_info.global_step == 7
