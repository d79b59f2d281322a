"""TorchScript export of the trained network: raw features in, probabilities out, signature and smoke set."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from hybridtrain.config import ModelSpec
from hybridtrain.errors import TrainingJobError
from hybridtrain.export import SMOKE_ROWS, difference_from_engine, export_model
from hybridtrain.features import standardization
from hybridtrain.model import build_network

COLUMNS = ("spend_30d", "visits_7d", "tenure_days")
SPEC = ModelSpec(hidden_sizes=(8, 4), dropout=0.1, preset=None)


@pytest.fixture
def exported(tmp_path):
    torch.manual_seed(0)
    raw = (
        np.random.default_rng(0)
        .normal(loc=[100, 3, 900], scale=[30, 1, 300], size=(64, 3))
        .astype(np.float32)
    )
    mean, std = standardization(raw)
    network = build_network(len(COLUMNS), SPEC)
    export_dir = tmp_path / "export"
    export_dir.mkdir()
    (export_dir / "stale.txt").write_text("from an earlier attempt")
    result = export_model(
        network.state_dict(),
        spec=SPEC,
        mean=mean,
        std=std,
        feature_columns=COLUMNS,
        smoke_inputs=raw[:SMOKE_ROWS],
        export_dir=export_dir,
        details={"step": 12, "run_id": "r1"},
    )
    expected = torch.sigmoid(network.eval()(torch.from_numpy((raw - mean) / std))).detach().numpy()
    return export_dir, result, raw, expected


def test_training_export_is_torchscript_of_probabilities_on_raw_features(exported):
    export_dir, result, raw, expected = exported
    model = torch.jit.load(str(export_dir / "model.pt"))
    assert isinstance(model, torch.jit.ScriptModule)
    outputs = model(torch.from_numpy(raw))
    assert outputs.dtype == torch.float32 and tuple(outputs.shape) == (64, 1)
    assert ((outputs > 0) & (outputs < 1)).all()
    np.testing.assert_allclose(outputs.detach().numpy(), expected, rtol=1e-5, atol=1e-6)
    assert result["model"] == str(export_dir / "model.pt")


def test_training_export_signature_names_triton_tensors(exported):
    export_dir, _, _, _ = exported
    signature = json.loads((export_dir / "signature.json").read_text())
    assert signature["feature_columns"] == list(COLUMNS)
    assert signature["n_features"] == 3
    assert signature["inputs"] == [{"name": "INPUT__0", "dtype": "float32", "shape": [-1, 3]}]
    assert signature["outputs"][0] | {"meaning": None} == {
        "name": "OUTPUT__0",
        "dtype": "float32",
        "shape": [-1, 1],
        "meaning": None,
    }
    assert (signature["step"], signature["run_id"], signature["format"]) == (12, "r1", "torchscript")


def test_training_export_smoke_set_reproduces_with_the_saved_model(exported):
    export_dir, _, raw, _ = exported
    smoke = json.loads((export_dir / "smoke.json").read_text())
    assert len(smoke["inputs"]) == len(smoke["outputs"]) == SMOKE_ROWS
    assert (smoke["input_name"], smoke["output_name"]) == ("INPUT__0", "OUTPUT__0")
    np.testing.assert_array_equal(np.array(smoke["inputs"], dtype=np.float32), raw[:SMOKE_ROWS])
    model = torch.jit.load(str(export_dir / "model.pt"))
    outputs = model(torch.tensor(smoke["inputs"], dtype=torch.float32)).detach().numpy()
    np.testing.assert_allclose(outputs, np.array(smoke["outputs"]), atol=smoke["atol"])


def test_training_export_replaces_the_previous_export_whole(exported):
    export_dir, _, _, _ = exported
    assert sorted(path.name for path in export_dir.iterdir()) == ["model.pt", "signature.json", "smoke.json"]
    assert [path.name for path in export_dir.parent.iterdir()] == ["export"]


def test_training_export_records_its_bf16_check_in_the_signature(exported):
    export_dir, result, _, _ = exported
    precision = json.loads((export_dir / "signature.json").read_text())["precision"]
    assert result["precision"] == precision
    # the fixture passes no holdout sample: without labels the AUC cannot be compared, so scoring stays fp32
    assert precision["scoring"] == "fp32"
    assert precision["check"]["rows"] == SMOKE_ROWS and precision["check"]["labelled_rows"] == 0
    assert "AUC could not be compared" in precision["check"]["reason"]


def _probability_model(weight: float, bias: float) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Sigmoid()).eval()
    with torch.no_grad():
        model[0].weight.fill_(weight)
        model[0].bias.fill_(bias)
    return model


@pytest.mark.parametrize("weight, bias, centre, spread, scoring, reason", [
    # standardised-like inputs: bf16 rounding moves no probability by 0.01
    (1.0, 0.0, 0.0, 1.0, "bf16",
     r"max \|p_bf16 - p_fp32\| \S+ \(limit 0.01\), AUC loss \S+ \+- \S+ on 2000 rows, at least \S+ \(limit 0.001\)"),
    # raw values near 1000 cancelled by the bias: bf16's spacing there (4) swamps the signal
    (1.0, -1000.0, 1000.0, 1.0, "fp32", r"max \|p_bf16 - p_fp32\|"),
])
def test_training_precision_check_allows_bf16_only_within_the_limits(weight, bias, centre, spread, scoring, reason):
    from hybridtrain.export import BF16_LIMITS, precision_check

    rng = np.random.default_rng(0)
    inputs = rng.normal(centre, spread, size=(2000, 1)).astype(np.float32)
    labels = (inputs[:, 0] - centre + rng.normal(0, 0.5, 2000) > 0).astype(np.float32)
    result = precision_check(_probability_model(weight, bias), inputs, labels, "cpu")
    check = result["check"]
    assert result["scoring"] == scoring
    assert check["limits"] == BF16_LIMITS and check["rows"] == check["labelled_rows"] == 2000
    assert (check["max_abs_diff"] <= 0.01 and check["auc_loss_bound"] <= 0.001) == (scoring == "bf16")
    assert re.search(reason, check["reason"])


class ScoresByRow:
    """A model of fixed scores per row (the row's one input is its index), others under bf16 autocast."""

    def __init__(self, fp32: np.ndarray, bf16: np.ndarray) -> None:
        self.fp32, self.bf16 = fp32.astype(np.float32), bf16.astype(np.float32)

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        scores = self.bf16 if torch.is_autocast_enabled("cpu") else self.fp32
        return torch.from_numpy(scores[rows[:, 0].long().numpy()]).reshape(-1, 1)


@pytest.mark.parametrize("rows, amplitude, seed, scoring", [
    # bf16 loses 0.00118 of the AUC, +- 0.00078: noise on 1,200 rows, which the check once refused bf16 for
    (1_200, 0.004, 10, "bf16"),
    # 0.00162 +- 0.00016 on 100,000 rows: a loss beyond the limit
    (100_000, 0.008, 0, "fp32"),
], ids=["noise-on-a-small-holdout", "a-loss-beyond-the-limit"])
def test_training_precision_check_judges_the_auc_loss_against_its_noise(rows, amplitude, seed, scoring):
    from hybridtrain.export import BF16_LIMITS, precision_check

    rng = np.random.default_rng(seed)
    signal = rng.normal(size=rows)
    labels = (signal + rng.normal(0, 1.0, rows) > 0).astype(np.float32)
    fp32 = 0.5 + 0.05 * signal
    model = ScoresByRow(fp32, fp32 + rng.uniform(-amplitude, amplitude, rows))
    result = precision_check(model, np.arange(rows, dtype=np.float32).reshape(-1, 1), labels, "cpu")
    check = result["check"]
    assert result["scoring"] == scoring
    assert check["max_abs_diff"] <= BF16_LIMITS["max_abs_diff"] and check["auc_diff"] > BF16_LIMITS["auc_diff"]
    assert check["auc_loss"] == pytest.approx(check["auc_fp32"] - check["auc_bf16"])
    assert check["labelled_rows"] == rows and check["auc_loss_se"] > 0
    assert (check["auc_loss_bound"] <= BF16_LIMITS["auc_diff"]) == (scoring == "bf16")
    assert f"on {rows} rows" in check["reason"]


def test_training_precision_check_scores_labels_against_the_rows_after_the_smoke_set():
    from hybridtrain.export import precision_check

    smoke = np.full((16, 1), 50.0, dtype=np.float32)  # constant rows that would break the AUC if counted
    holdout = np.linspace(-3, 3, 200, dtype=np.float32).reshape(-1, 1)
    labels = (holdout[:, 0] > 0).astype(np.float32)
    result = precision_check(_probability_model(1.0, 0.0), np.concatenate([smoke, holdout]), labels, "cpu")
    assert result["check"]["auc_fp32"] == 1.0 and result["check"]["rows"] == 216


@pytest.mark.parametrize(("engine_float32", "off_by", "fails"), [
    (True, 5e-6, False), (True, 5e-5, True), (False, 1e-2, False), (False, 5e-2, True)])
def test_the_export_must_score_the_smoke_rows_as_the_trained_engine_does(tmp_path, engine_float32, off_by, fails):
    outputs = np.array([[0.25], [0.75]])
    (tmp_path / "smoke.json").write_text(json.dumps({"outputs": outputs.tolist()}))
    engine_outputs = outputs + np.array([[0.0], [off_by]])
    if fails:
        with pytest.raises(TrainingJobError, match="differs from the trained engine .* is not trustworthy"):
            difference_from_engine(tmp_path, engine_outputs, engine_float32=engine_float32)
    else:
        assert difference_from_engine(tmp_path, engine_outputs, engine_float32=engine_float32) == pytest.approx(off_by)
