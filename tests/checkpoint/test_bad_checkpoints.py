"""Damaged, misplaced and mismatched checkpoints: each is a ValueError saying what is wrong and what to do,
resuming falls back to the newest intact checkpoint, and nothing on disk is deleted or overwritten unasked."""

import hashlib
import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

import unipg.runtime.lm as text
from tests.helpers.configs import resumable_config
from unipg.checkpoint.files import load_checkpoint, tensor_mismatch, verify_checkpoint
from unipg.checkpoint.lm import latest_checkpoint
from unipg.checkpoint.store import CheckpointStore
from unipg.cli import app
from unipg.observe.metrics import read_metrics
from unipg.runtime.lm import train_lm
from unipg.tasks.rewards.rules import REWARDS


def small_config(embedded_path, output_dir, name, updates, *extra):
    """The resume tests' small run, without evaluation, keeping 3 checkpoints."""
    return resumable_config(
        embedded_path,
        output_dir,
        name,
        updates,
        "eval.every_updates=100",
        "eval.pass_k=0",
        "checkpoint.keep_last=3",
        *extra,
    )


def one_line(output: str) -> str:
    return " ".join(output.split())


def saved(step: int, value: float = 1.0, store_root=None) -> None:
    CheckpointStore(store_root).save(step, {"policy": {"w": torch.full((3, 2), value)}}, {"step": step})


def flip_last_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def fingerprint(folder) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.iterdir())}


def rewrite_manifest(folder, change) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    change(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def checksum_again(folder, name) -> None:
    """Make the manifest agree with ``name`` as it is now, as a careless hand edit of both would."""
    data = (folder / name).read_bytes()
    entry = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    rewrite_manifest(folder, lambda manifest: manifest["files"].update({name: entry}))


# --- one checkpoint folder -----------------------------------------------------------------------------


def truncate_weights(folder):
    weights = folder / "policy.safetensors"
    weights.write_bytes(weights.read_bytes()[:40])


def tamper_weights(folder):
    flip_last_byte(folder / "policy.safetensors")


def truncate_manifest(folder):
    manifest = folder / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:25])


def garble_manifest(folder):
    (folder / "manifest.json").write_bytes(b"\xff\xfe{not json")


def tamper_manifest_checksum(folder):
    rewrite_manifest(folder, lambda manifest: manifest["files"]["policy.safetensors"].update(sha256="0" * 64))


def drop_checksums(folder):
    rewrite_manifest(folder, lambda manifest: manifest.pop("files"))


def forget_a_checksum(folder):
    rewrite_manifest(folder, lambda manifest: manifest["files"].pop("policy.safetensors"))


def manifest_of_a_list(folder):
    (folder / "manifest.json").write_text("[1, 2]")


def delete_state(folder):
    (folder / "state.json").unlink()


def truncate_weights_and_checksum_again(folder):
    truncate_weights(folder)
    checksum_again(folder, "policy.safetensors")


def garble_state_and_checksum_again(folder):
    (folder / "state.json").write_text('{"step": ')
    checksum_again(folder, "state.json")


@pytest.mark.parametrize(
    "damage, problem",
    [
        (truncate_weights, r"policy\.safetensors does not match the size and sha256 checksum in its manifest"),
        (tamper_weights, r"policy\.safetensors does not match the size and sha256 checksum in its manifest"),
        (truncate_manifest, r"manifest\.json is not valid JSON \(.*\)"),
        (garble_manifest, r"manifest\.json is not valid JSON \(.*\)"),
        (tamper_manifest_checksum, r"policy\.safetensors does not match the size and sha256 checksum in its manifest"),
        (drop_checksums, r"manifest\.json lacks the 'files' or 'tensor_groups' object"),
        (forget_a_checksum, r"manifest\.json lists tensor group 'policy' without a checksummed file or its aliases"),
        (manifest_of_a_list, r"manifest\.json is not an object with an integer format_version"),
        (delete_state, r"file 'state\.json' listed in the manifest is missing"),
        (truncate_weights_and_checksum_again, r"policy\.safetensors is not a readable safetensors file \(.*\)"),
        (garble_state_and_checksum_again, r"state\.json is not valid JSON \(.*\)"),
    ],
)
def test_a_damaged_checkpoint_says_which_file_is_wrong_and_the_older_one_is_used(tmp_path, damage, problem):
    saved(1, 1.0, tmp_path)
    saved(2, 2.0, tmp_path)
    newest = tmp_path / "step-00000002"
    damage(newest)
    with pytest.raises(
        ValueError,
        match=f"checkpoint {newest} is corrupted or incomplete: {problem}; load an "
        r"older checkpoint \(CheckpointStore.latest\(\) skips corrupted ones\)",
    ):
        load_checkpoint(newest)
    with pytest.warns(RuntimeWarning, match="skipping checkpoint step-00000002: .*corrupted"):
        latest = CheckpointStore(tmp_path).latest()
    assert latest == tmp_path / "step-00000001"
    assert torch.equal(load_checkpoint(latest).tensors["policy"]["w"], torch.full((3, 2), 1.0))


def test_a_path_that_is_not_a_checkpoint_folder_says_so(tmp_path):
    for path, problem in (
        (tmp_path / "missing", "does not exist"),
        (tmp_path / "file", "is a file, not a checkpoint folder"),
    ):
        if path.name == "file":
            path.write_text("weights")
        with pytest.raises(
            ValueError,
            match=f"checkpoint {path} {problem}; pass a step-<number> folder written by CheckpointStore.save",
        ):
            load_checkpoint(path)
        with pytest.raises(ValueError, match=problem):
            verify_checkpoint(path)


def test_a_checkpoint_root_that_is_a_file_or_empty_is_reported_and_left_alone(tmp_path):
    root = tmp_path / "checkpoints"
    root.write_text("not a folder")
    store = CheckpointStore(root)
    assert store.list() == [] and store.latest() is None
    with pytest.raises(
        ValueError,
        match=f"cannot save checkpoints in {root}: it is a file, not a folder; move the "
        "file away or choose another checkpoint folder",
    ):
        saved(1, 1.0, root)
    assert root.read_text() == "not a folder"
    assert CheckpointStore(tmp_path / "empty").latest() is None


def test_a_save_sets_a_damaged_checkpoint_of_its_step_aside_instead_of_replacing_it(tmp_path):
    saved(1, 1.0, tmp_path)
    saved(2, 2.0, tmp_path)
    damaged = tmp_path / "step-00000002"
    tamper_weights(damaged)
    before = fingerprint(damaged)
    with pytest.warns(RuntimeWarning, match="step-00000002 failed verification; kept as damaged-step-00000002"):
        saved(2, 3.0, tmp_path)
    assert fingerprint(tmp_path / "damaged-step-00000002") == before
    assert torch.equal(load_checkpoint(damaged).tensors["policy"]["w"], torch.full((3, 2), 3.0))
    tamper_weights(damaged)
    with pytest.warns(RuntimeWarning, match="kept as damaged-step-00000002-2"):
        saved(2, 4.0, tmp_path)
    for _ in range(3):  # rotation never touches what was set aside
        saved(3, 1.0, tmp_path)
    assert (tmp_path / "damaged-step-00000002").is_dir() and (tmp_path / "damaged-step-00000002-2").is_dir()
    assert [path.name for path in CheckpointStore(tmp_path).list()] == [
        "step-00000001",
        "step-00000002",
        "step-00000003",
    ]


def test_tensor_mismatch_names_shapes_and_missing_tensors():
    expected = {"embed.weight": torch.zeros(10, 4), "head.weight": torch.zeros(2, 4), "norm.weight": torch.zeros(4)}
    assert tensor_mismatch(dict(expected), expected) is None
    saved_tensors = {"embed.weight": torch.zeros(10, 8), "head.weight": torch.zeros(2, 8), "extra.bias": torch.zeros(1)}
    assert tensor_mismatch(saved_tensors, expected) == (
        "2 tensor(s) differ in shape, e.g. embed.weight is (10, 8) in the checkpoint and (10, 4) in the model; "
        "1 tensor(s) of the model are not in the checkpoint, e.g. norm.weight; "
        "1 tensor(s) of the checkpoint are not in the model, e.g. extra.bias"
    )


# --- runs ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_updates(embedded_path, tmp_path_factory):
    """A finished run of 2 updates with checkpoints of both; tests work on copies of its folder."""
    return train_lm(small_config(embedded_path, tmp_path_factory.mktemp("runs"), "two", 2)).run_dir


@pytest.fixture
def run_copy(two_updates, tmp_path):
    return shutil.copytree(two_updates, tmp_path / "run")


@pytest.mark.e2e
def test_resume_falls_back_to_the_newest_intact_checkpoint_and_keeps_the_damaged_one(embedded_path, run_copy):
    damaged = run_copy / "checkpoints" / "step-00000002"
    tamper_weights(damaged)
    before = fingerprint(damaged)
    with pytest.warns(RuntimeWarning) as caught:
        resumed = train_lm(small_config(embedded_path, run_copy.parent, "run", 3), resume=run_copy)
    messages = [str(warning.message) for warning in caught]
    assert any(message.startswith("skipping checkpoint step-00000002: ") for message in messages)
    assert (
        "resuming from step-00000001, the newest intact checkpoint; step-00000002 could not be used (see the "
        "warnings above) and stay where they are"
    ) in messages
    # the resumed run's save of update 2 sets the damaged folder aside rather than replacing it
    assert any("kept as damaged-step-00000002 instead of being replaced" in message for message in messages)
    assert resumed.resumed_from == 1 and resumed.updates == 3
    assert fingerprint(run_copy / "checkpoints" / "damaged-step-00000002") == before
    store = CheckpointStore(run_copy / "checkpoints")
    assert [path.name for path in store.list()] == ["step-00000001", "step-00000002", "step-00000003"]
    assert all(verify_checkpoint(path) for path in store.list())
    assert [record["step"] for record in read_metrics(run_copy)] == [0, 1, 2, 3]


@pytest.mark.e2e
def test_resume_with_another_model_names_both_models_and_changes_nothing(embedded_path, run_copy):
    before = {path.name: fingerprint(path) for path in (run_copy / "checkpoints").iterdir()}
    metrics = (run_copy / "metrics.jsonl").read_text()
    with pytest.raises(ValueError) as raised:
        train_lm(
            small_config(embedded_path, run_copy.parent, "run", 3, "model.name=embedded:small"),
            resume=run_copy,
            log=lambda message: None,
        )
    message = str(raised.value)
    assert message.startswith(
        f"checkpoint {run_copy / 'checkpoints' / 'step-00000002'} does not fit the "
        f"configured model: it was written for {embedded_path}, the configuration asks for "
        "embedded:small (policy: "
    )
    assert "tensor(s) differ in shape, e.g. model.embed_tokens.weight is (" in message
    assert message.endswith("resume with the run's own config.yaml, leaving model.* as it was")
    assert "\n" not in message
    result = CliRunner().invoke(
        app, ["train", "--resume", str(run_copy), "train.updates=3", "model.name=embedded:small"]
    )
    output = one_line(result.output)
    assert result.exit_code == 2 and "does not fit the configured model" in output and "Traceback" not in output
    assert {path.name: fingerprint(path) for path in (run_copy / "checkpoints").iterdir()} == before
    assert (run_copy / "metrics.jsonl").read_text() == metrics


@pytest.mark.e2e
def test_resume_from_a_run_without_checkpoints_says_how_to_go_on(run_copy):
    shutil.rmtree(run_copy / "checkpoints")
    with pytest.raises(
        ValueError,
        match=f"cannot resume from '{run_copy}': it holds no checkpoint .*; start a new "
        "run instead, or set checkpoint.every_updates",
    ):
        latest_checkpoint(run_copy)


@pytest.mark.e2e
def test_a_reward_that_fails_mid_run_stops_it_in_one_line_and_keeps_the_checkpoint(
    embedded_path, tmp_path, monkeypatch
):
    failing = {"now": False}

    def flaky_grader(prompts, completions, **columns):
        if failing["now"]:
            raise ConnectionError("grading service unreachable")
        return [0.5 for _ in completions]

    monkeypatch.setattr(REWARDS, "_entries", dict(REWARDS._entries))  # registration undone after the test
    REWARDS.register("flaky_grader")(lambda: flaky_grader)
    original = text.rollout_batch

    def fail_from_the_next_rollout(*args, **kwargs):
        failing["now"] = True  # update 1's rewards are in; update 2's rollout will fail
        return original(*args, **kwargs)

    monkeypatch.setattr(text, "rollout_batch", fail_from_the_next_rollout)
    config = small_config(embedded_path, tmp_path, "flaky", 3, "task.rewards=[{name: flaky_grader}]")
    with pytest.raises(ValueError) as raised:
        train_lm(config)
    expected = (
        "reward function 'flaky_grader' failed: grading service unreachable (ConnectionError); fix the "
        "function, or leave it out of the rewards (its traceback is this error's cause)"
    )
    assert expected in str(raised.value) and "\n" not in str(raised.value)
    run_dir = tmp_path / "flaky"
    store = CheckpointStore(run_dir / "checkpoints")
    assert [path.name for path in store.list()] == ["step-00000001"]
    checkpoint = load_checkpoint(store.latest())
    assert checkpoint.state["update"] == 1 and "policy" in checkpoint.tensors
    before = fingerprint(store.latest())

    result = CliRunner().invoke(app, ["train", "--resume", str(run_dir)])  # the grader is still down
    output = one_line(result.output)
    assert result.exit_code == 2 and expected in output and "Traceback" not in output
    assert fingerprint(store.latest()) == before and [p.name for p in store.list()] == ["step-00000001"]
    assert [record["step"] for record in read_metrics(run_dir)] == [0, 1]
