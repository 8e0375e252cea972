"""Every position's logits from an OpenVINO IR model, for the KL of OpenVINO's own formats against the fp32 model.

It runs under `make openvino-peer`'s .peers-openvino venv, which has no kvyard, so it imports nothing from
kvyard. usage: python openvino_logits.py MODEL_DIR THREADS SEQUENCES_JSON OUT_DIR

SEQUENCES_JSON holds [[token ids], ...]. Each sequence runs through the stateful model in one inference (its state
reset first), on the CPU plugin with its default settings (its inference precision, and its dynamic quantization
of activations for compressed weights where it applies them), and its logits [len, vocab] go to OUT_DIR/i.npy as
float32. The last line out is {"inference_precision": ..., "sequences": n}, or {"error": ...} with exit status 1.
"""

import json
import sys
from pathlib import Path


def main() -> None:
    try:
        import numpy as np
        import openvino as ov

        model_dir, threads, sequences_json, out_dir = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
        core = ov.Core()
        compiled = core.compile_model(core.read_model(model_dir / "openvino_model.xml"), "CPU",
                                      {"INFERENCE_NUM_THREADS": threads})
        request = compiled.create_infer_request()
        names = {name for port in compiled.inputs for name in port.get_names()}
        sequences = json.loads(Path(sequences_json).read_text())
        for i, ids in enumerate(sequences):
            request.reset_state()
            n = len(ids)
            inputs = {"input_ids": np.array([ids], dtype=np.int64),
                      "attention_mask": np.ones((1, n), dtype=np.int64),
                      "position_ids": np.arange(n, dtype=np.int64)[None],
                      "beam_idx": np.zeros(1, dtype=np.int32)}
            request.infer({k: v for k, v in inputs.items() if k in names})
            np.save(out_dir / f"{i}.npy", np.asarray(request.get_tensor("logits").data[0], dtype=np.float32))
        precision = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
        print(json.dumps({"inference_precision": precision, "sequences": len(sequences)}), flush=True)
    except Exception as e:  # reported to the parent, which raises it
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
