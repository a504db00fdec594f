"""CI's smoke run of benchmarks/cpu_twins.py: every case runs, on small sizes, and reports a time
for each implementation (the full run's numbers: benchmarks/results/cpu-2026-12-02.md)."""

import cpu_twins


def test_cpu_twins_smoke():
    results = cpu_twins.run(smoke=True)
    assert len(results) == 1 + 2 * len(cpu_twins.ACTIVATIONS) + 2 * 6 * 2
    for name, impls in results.items():
        assert {"brrr", "torch"} <= set(impls), name
        assert all(median > 0 for median, _ in impls.values()), name
