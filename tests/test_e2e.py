"""End-to-end runs through the command line on a tiny synthetic corpus.

One test per user-facing command: train, determinism, resume after SIGKILL, eval on an
external data dir, enroll/verify, export, and clear errors for bad configs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kill import train_until_killed
from tiny_corpus import TINY_DATA, TINY_EVAL
from typer.testing import CliRunner

from fedvox.cli import app
from fedvox.data.synthetic import SyntheticConfig, ensure_corpus
from fedvox.errors import FedvoxError
from fedvox.records import TrainRecord, read_run_log

runner = CliRunner()

TINY = (
    '\nname = "tiny"\nseed = {seed}\n'
    + TINY_DATA
    + """[train]
steps = {steps}
batch_size = 16
chunk_frames = [60, 100]
checkpoint_every = {ckpt}
warmup_steps = 5
lr = 0.003
threads = 1
"""
    + TINY_EVAL
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def write_cfg(folder: Path, cache: Path, seed: int = 0, steps: int = 30, ckpt: int = 10) -> Path:
    p = folder / f"tiny-{seed}-{steps}.toml"
    p.write_text(TINY.format(seed=seed, cache=cache, steps=steps, ckpt=ckpt))
    return p


def invoke(*args: str):
    res = runner.invoke(app, [*map(str, args)], catch_exceptions=False)
    return res


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> Path:
    d = tmp_path_factory.mktemp("runs")
    cfg = write_cfg(d, cache, steps=60)
    res = invoke("train", cfg, "--out", d / "run", "-q")
    assert res.exit_code == 0, res.output
    return d / "run"


def test_train_writes_a_complete_run_folder(trained: Path) -> None:
    for name in (
        "config.toml",
        "manifest.json",
        "metrics.jsonl",
        "model.pt",
        "metrics.json",
        "det.png",
        "report.md",
        "calibration.json",
        "backend/backend.npz",
    ):
        assert (trained / name).is_file(), name
    assert list((trained / "checkpoints").glob("ckpt-*.pt"))
    metrics = json.loads((trained / "metrics.json").read_text())
    for backend in ("cosine", "asnorm", "plda"):
        assert 0.0 <= metrics["backends"][backend]["eer"] <= 1.0
    report = (trained / "report.md").read_text()
    assert "| system | EER |" in report and "det.png" in report
    assert "non-learned baseline" in report and "barely trained" in report
    losses = [r.loss for r in read_run_log(trained / "metrics.jsonl", (TrainRecord,))]
    assert losses[-1] < losses[0], "training loss must go down"


def test_same_seed_same_bits_and_different_seed_differs(
    tmp_path: Path, cache: Path, trained: Path
) -> None:
    a = json.loads((trained / "metrics.json").read_text())
    res = invoke("train", write_cfg(tmp_path, cache, steps=60), "--out", tmp_path / "again", "-q")
    assert res.exit_code == 0, res.output
    b = json.loads((tmp_path / "again" / "metrics.json").read_text())
    assert a == b  # identical metrics and weight hash
    res = invoke(
        "train", write_cfg(tmp_path, cache, seed=1, steps=60), "--out", tmp_path / "other", "-q"
    )
    c = json.loads((tmp_path / "other" / "metrics.json").read_text())
    assert c["weights_sha256"] != a["weights_sha256"]
    assert c["backends"] != a["backends"]


def test_resume_after_sigkill_is_bit_identical(tmp_path: Path, cache: Path) -> None:
    cfg = write_cfg(tmp_path, cache, steps=80, ckpt=10)
    ref = invoke("train", cfg, "--out", tmp_path / "ref", "-q")
    assert ref.exit_code == 0, ref.output
    run = tmp_path / "killed"
    train_until_killed(cfg, run, checkpoint=20)
    res = invoke("resume", run, "-q")
    assert res.exit_code == 0, res.output
    a = json.loads((tmp_path / "ref" / "metrics.json").read_text())
    b = json.loads((run / "metrics.json").read_text())
    assert a["weights_sha256"] == b["weights_sha256"]
    assert a == b


def test_eval_on_an_external_kaldi_dir(trained: Path, tmp_path: Path) -> None:
    other = ensure_corpus(
        SyntheticConfig(
            seed=77,
            n_train_speakers=2,
            n_test_speakers=3,
            train_utts_per_speaker=2,
            test_utts_per_speaker=3,
            min_duration_s=1.0,
            max_duration_s=1.5,
            difficulty="hard",
        ),
        cache_root=tmp_path,
        workers=1,
        progress=False,
    )
    res = invoke(
        "eval",
        trained,
        "--data",
        other / "test",
        "--trials",
        other / "test" / "trials_kaldi.txt",
        "--out",
        tmp_path / "ev",
        "-q",
    )
    assert res.exit_code == 0, res.output
    m = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    assert set(m) == {"cosine", "asnorm", "plda"}
    assert m["cosine"]["n_target"] == 9  # 3 speakers x C(3,2) target pairs
    assert (tmp_path / "ev" / "det.png").stat().st_size > 1000


def test_enroll_verify_round_trip(trained: Path, tmp_path: Path) -> None:
    root = Path(json.loads((trained / "manifest.json").read_text())["corpus_dir"]) / "test"
    spk2utt = {}
    for line in (root / "wav.scp").read_text().splitlines():
        utt, path = line.split()
        spk2utt.setdefault(utt.rsplit("-", 1)[0], []).append(root / path)
    speakers = sorted(spk2utt)
    own, other = spk2utt[speakers[0]], spk2utt[speakers[1]]
    prof = tmp_path / "p.json"
    res = invoke("enroll", trained, *own[:2], "--speaker", speakers[0], "--out", prof)
    assert res.exit_code == 0, res.output
    accept = invoke("verify", prof, own[2])
    reject = invoke("verify", prof, other[0])
    assert accept.exit_code == 0 and "ACCEPT" in accept.output, accept.output
    assert reject.exit_code == 1 and "REJECT" in reject.output, reject.output


def test_export_torchscript_and_onnx_match_eager(trained: Path, tmp_path: Path) -> None:
    res = invoke("export", trained, "--out", tmp_path / "x.pt")
    assert res.exit_code == 0, res.output
    m = torch.jit.load(str(tmp_path / "x.pt"))
    assert m(torch.randn(1, 123, 30)).shape[0] == 1
    res = invoke("export", trained, "--out", tmp_path / "x.onnx", "--format", "onnx")
    assert res.exit_code == 0, res.output
    import onnx
    from onnx.reference import ReferenceEvaluator

    x = torch.randn(2, 151, 30)
    (got,) = ReferenceEvaluator(onnx.load(str(tmp_path / "x.onnx"))).run(None, {"feats": x.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(got), m(x), atol=1e-4, rtol=1e-4)
    with pytest.raises(FedvoxError, match="unknown export format"):
        invoke("export", trained, "--format", "tflite")


def test_bad_config_is_refused_with_the_field_named(tmp_path: Path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text("[train]\nsteps = -5\n")
    proc = subprocess.run(
        [sys.executable, "-m", "fedvox.cli", "train", str(p)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "train.steps" in proc.stderr and "Traceback" not in proc.stderr


def test_every_command_has_help() -> None:
    for cmd in (
        "demo",
        "prepare",
        "train",
        "resume",
        "eval",
        "enroll",
        "verify",
        "export",
        "config",
    ):
        res = invoke(cmd, "--help")
        assert res.exit_code == 0 and "Usage" in res.output, cmd


def test_demo_results_file_holds_the_printed_numbers(tmp_path: Path, cache: Path) -> None:
    sets = {
        "data.cache_dir": f'"{cache}"',
        "data.workers": "1",
        "data.synthetic.n_train_speakers": "8",
        "data.synthetic.n_test_speakers": "4",
        "data.synthetic.train_utts_per_speaker": "5",
        "data.synthetic.test_utts_per_speaker": "3",
        "data.synthetic.min_duration_s": "1.0",
        "data.synthetic.max_duration_s": "1.5",
        "data.synthetic.difficulty": '"clean"',
        "train.steps": "8",
        "train.batch_size": "8",
        "train.chunk_frames": "[60, 80]",
        "train.threads": "1",
        "eval.asnorm_top_n": "4",
        "eval.lda_dim": "6",
    }
    args = [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
    out = tmp_path / "results" / "demo.json"
    res = invoke("demo", "--out", tmp_path / "d", "-q", "--results", out, *args)
    assert res.exit_code == 0, res.output
    got = json.loads(out.read_text())
    metrics = json.loads((tmp_path / "d" / "metrics.json").read_text())
    assert got["weights_sha256"] == metrics["weights_sha256"]
    for name, m in metrics["backends"].items():
        assert got["systems"][name]["eer_pct"] == round(100 * m["eer"], 2)
        assert f"{got['systems'][name]['eer_pct']:.2f}%" in res.output  # what was printed
    assert {"barely_trained", "baseline"} <= set(got["systems"])
    assert got["wall_s"] > 0 and got["cpu_isa"] == torch.backends.cpu.get_cpu_capability()
