"""A small measured cost profile (as a dict) for the simulator's tests."""

from tandem.sim.profile import SCHEMA

MEASURED = {
    "schema": SCHEMA, "kind": "measured", "name": "t",
    "forward": {"base": 0.01, "per_token": 0.001, "per_seq": 0.0, "per_context": 0.0, "per_pair": 0.0},
    "overhead": {"base": 0.002, "per_token": 0.0, "per_seq": 0.0001, "per_context": 0.0, "per_pair": 0.0},
    "kv_num_blocks": 2048, "block_size": 16, "max_model_len": 4096, "machine": "test cpu", "model": "m",
    "dtype": "float32", "quantization": "none", "date": "2026-01-01 00:00",
}
