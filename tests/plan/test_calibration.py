"""`kvyard plan --measure` reads back the latest fit `kvyard bench plan` recorded on this CPU."""

import json

from kvyard.plan.calibration import latest_calibration, rank_key
from kvyard.plan.layouts import Layout
from kvyard.plan.rates import LayerCost


def _entry(cpu: str, fixed: float) -> str:
    return json.dumps({"machine": {"cpu": cpu}, "layer_cost": {"fixed_s": fixed, "per_row_hidden_s": 1e-9},
                       "rank_layer_costs": {rank_key(1, False): {"fixed_s": 2 * fixed, "per_row_hidden_s": 0.0}},
                       "syncs": {"tensor_sync_s": 0.002}, "model": "m", "figure": "f"})


def test_the_latest_fit_of_this_cpu_is_applied_and_another_cpus_is_not(tmp_path):
    record = tmp_path / "record.jsonl"
    record.write_text("\n".join([_entry("xeon", 1e-5), _entry("xeon", 3e-5), _entry("epyc", 9e-5), '{"cut sh']))
    fitted = latest_calibration(record, "xeon")
    assert fitted is not None and fitted.layer_cost == LayerCost(3e-5, 1e-9) and fitted.syncs == {"tensor_sync_s": 0.002}
    one, tensor, stages = (Layout(tp, pp, 1.0, 1.0, 1.0) for tp, pp in ((1, 1), (2, 1), (1, 2)))
    assert fitted.layer_cost_of(one, 2) == fitted.layer_cost
    assert fitted.layer_cost_of(tensor, 1) == LayerCost(6e-5, 0.0)  # a tensor rank runs layer by layer
    assert fitted.layer_cost_of(stages, 1) is None  # no stage was calibrated at one thread with the stack
    assert latest_calibration(record, "zen 5") is None and latest_calibration(tmp_path / "none", "xeon") is None
