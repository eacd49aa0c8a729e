"""benchmarks/bench_mixed_pass.py on the embedded pair: one row per batch size x rows, four
timings each, the kinds of pass it names."""

from benchmarks import bench_mixed_pass


def test_mixed_pass_bench_times_every_kind_of_pass(capsys):
    bench_mixed_pass.main(["--batch", "2", "3", "--rows", "2", "--context", "20", "--chunk", "8", "--repeats", "1"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 2 x 2 |") or line.startswith("| 3 x 2 |")]
    assert len(rows) == 2
    for line in rows:
        uniform, cut, beside, apart = (float(x) for x in line.strip("| ").split("|")[1:])
        assert 0 < uniform and 0 < cut and 0 < beside and apart > uniform
    assert "prompt chunk 8 tokens alone" in out
