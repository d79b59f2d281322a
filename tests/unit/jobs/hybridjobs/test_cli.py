"""The jobs' shared command-line pieces: each expected failure maps to its documented exit code with the reason on
stderr, and bad ``--ds``/model arguments are usage errors (exit 2) that name the argument."""

import argparse

import pytest
from hybridjobs import cli, storage
from hybridjobs.predictions import ModelContractError


class NotPublishedSubclass(storage.PartitionNotPublishedError):
    pass


@pytest.mark.parametrize(("err", "code"), [
    (storage.PartitionNotPublishedError("features/ds=2026-01-05 has no _SUCCESS"), 2),
    (NotPublishedSubclass("late"), 2),
    (ModelContractError("takes 29 features, the manifest lists 30"), 3),
])
def test_failed_maps_each_expected_failure_to_its_exit_code(err, code, capsys):
    assert cli.failed("SCORING", "ds=2026-01-05", err) == code
    assert capsys.readouterr().err == f"SCORING FAILED ds=2026-01-05: {err}\n"


def test_a_storage_failure_has_its_own_exit_code_and_names_the_uri(capsys):
    from hybridjobs.objectstore import StorageError

    err = StorageError("s3://bucket/raw/ds=2026-01-05/_SUCCESS: bucket bucket does not exist")
    assert cli.storage_failed("RAW", "ds=2026-01-05", err) == cli.STORAGE_FAILED == 4
    assert capsys.readouterr().err == f"RAW FAILED ds=2026-01-05: {err}\n"
    assert cli.STORAGE_FAILED not in cli.EXIT_CODES.values()


def parser_with_model_args() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    cli.add_partition_args(parser)
    cli.add_model_args(parser, 1024, "TorchScript file")
    return parser


@pytest.mark.parametrize(("argv", "message"), [
    (["--root", "/r", "--ds", "2026-13-01"], "--ds"),
    (["--root", "/r", "--ds", "yesterday"], "--ds"),
    (["--root", "/r", "--ds", "2026-01-05\n"], "--ds"),
    (["--ds", "2026-01-05"], "--root"),
    (["--root", "/r", "--ds", "2026-01-05", "--batch-size", "0"], "--batch-size must be >= 1"),
    (["--root", "/r", "--ds", "2026-01-05", "--model-version", " "], "--model-version must not be empty"),
    (["--root", "/r", "--ds", "2026-01-05", "--model", "/no/such/model.pt"], "is not a file"),
])
def test_bad_arguments_are_usage_errors_naming_the_argument(argv, message, tmp_path, capsys):
    model = tmp_path / "model.pt"
    model.write_bytes(b"x")
    defaults = {"--model": str(model), "--model-version": "v1"}
    for flag, value in defaults.items():
        if flag not in argv:
            argv = [*argv, flag, value]
    parser = parser_with_model_args()
    with pytest.raises(SystemExit) as exited:
        cli.check_model_args(parser, parser.parse_args(argv))
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_good_arguments_come_back_normalised(tmp_path):
    model = tmp_path / "model.pt"
    model.write_bytes(b"x")
    parser = parser_with_model_args()
    args = parser.parse_args(["--root", "/r", "--ds", "2026-01-05", "--model", str(model), "--model-version", "v1"])
    cli.check_model_args(parser, args)
    assert (args.ds, args.batch_size) == ("2026-01-05", 1024)
