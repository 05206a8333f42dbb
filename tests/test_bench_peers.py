"""bench.py's peers section: ours, CTranslate2 and llama.cpp on one exported model; its plumbing only, at a
tiny shape. Speed itself is never asserted (docs/performance.md holds the measured table).

    python -m pytest tests/test_bench_peers.py
"""
import pytest

import bench
from benchmarks import peers
from core import runtime
from core.errors import UserError
from tests.helpers import cli_args, one_thread, use_gpt2_bpe

TINY = dict(sections="peers", threads=1, peers_n_layer=1, peers_n_head=2, peers_n_embd=64, peers_block_size=64,
            peers_new_tokens=4, peers_streams=2, peers_threads_all=1)


def test_every_precision_of_each_engine_is_one_row_and_a_missing_peer_is_one_line(tmp_path, monkeypatch):
    use_gpt2_bpe()
    monkeypatch.setattr(peers, "missing", lambda engine: "not installed (pip install ctranslate2)"
                        if engine == "ctranslate2" else None)
    with one_thread():
        result = bench.main(cli_args(TINY, out=tmp_path / "bench.json", peers_engines="ours,ctranslate2"))
    r = result["peers"]
    assert [(row["engine"], row["weights"]) for row in r["rows"]] == [("ours", "float32"), ("ours", "int8"),
                                                                     ("ours", "int4")]
    for row in r["rows"]:
        assert len(row["rates"]) == 3 and all(x > 0 for x in row["rates"]) and row["bound"] > 0
    bounds = [row["bound"] for row in r["rows"]]
    assert bounds[0] < bounds[1] < bounds[2]  # fewer bytes per weight, a higher bound
    text = peers.table(r)
    assert "ctranslate2: not installed (pip install ctranslate2)" in text.splitlines()
    assert "1 thread, tok/s" in text and "2 streams, 1 threads, tok/s" in text


def test_a_precision_an_engine_lacks_is_na_in_its_row():
    r = {"rows": [{"engine": "ctranslate2", "weights": "int4", "bound": 10.0, "rates": None},
                  {"engine": "ours", "weights": "int8", "bound": 20.0, "rates": [1.0, 2.0, 3.0]}],
         "absent": {}, "threads": [1, 8], "streams": 16, "bandwidth": 1e10, "new_tokens": 200, "prompt_len": 14,
         "shape": "12 x 768, 124M"}
    lines = peers.table(r).splitlines()
    int4 = next(line for line in lines if "int4" in line)
    assert int4.count("n/a") == 3 and "10.0" in int4
    assert "16 streams, 8 threads, tok/s" in peers.table(r)


@pytest.mark.parametrize("key, value, fragment", [("peers_engines", "ours,vllm", "peers_engines: unknown vllm"),
                                                  ("peers_new_tokens", 1, "'peers_new_tokens' must be at least 2"),
                                                  ("peers_new_tokens", 60, "exceed peers_block_size 64"),
                                                  ("peers_n_head", 5, "peers_n_embd .* divisible by peers_n_head")])
def test_bad_settings_are_one_line(key, value, fragment, tmp_path):
    with pytest.raises(UserError, match=fragment):
        bench.main(cli_args(TINY, out=tmp_path / "bench.json", **{key: value}))


def test_ours_rate_counts_every_stream_after_the_first_token(monkeypatch):
    """Scripted token times 5 s (the prefill and first token), then 1, 1 and 2 s: 2 streams x 3 tokens in 4 s."""
    monkeypatch.setattr(peers.decode, "token_times", lambda *args, **kwargs: [5.0, 1.0, 1.0, 2.0])
    cfg = bench.load_config(cli_args(TINY))
    assert peers.ours_rate(None, [1, 2], cfg, 1, 2, runtime.setup("cpu", "float32")) == 1.5


def test_the_peers_section_is_not_in_the_default_run():
    assert "peers" not in bench.General().sections.split(",")
