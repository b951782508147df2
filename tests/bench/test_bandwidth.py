import statistics

import numpy as np
import pytest

from specheads.bench.bandwidth import BandwidthProbe, format_bandwidth, summarize_bandwidth


def test_the_probe_reports_a_positive_rate_and_refuses_no_size():
    probe = BandwidthProbe(8)
    rates = [probe.sample() for _ in range(3)]
    assert all(r > 0 for r in rates)
    with pytest.raises(ValueError):
        BandwidthProbe(0)


def test_the_summary_against_numpy():
    samples = [100.0, 75.0, 108.0, 106.0, 80.0, 104.0, 107.0, 105.0, 103.0, 109.0, 70.0]
    s = summarize_bandwidth(samples, 256)
    assert s["samples"] == 11 and s["mib"] == 256
    assert s["median_gb_s"] == statistics.median(samples) == 104.0
    assert s["p10_gb_s"] == pytest.approx(np.percentile(samples, 10))  # numpy's linear = inclusive
    assert s["p90_gb_s"] == pytest.approx(np.percentile(samples, 90))
    assert s["p10_gb_s"] < s["median_gb_s"] < s["p90_gb_s"]
    one = summarize_bandwidth([50.0], 8)
    assert one["p10_gb_s"] == one["median_gb_s"] == one["p90_gb_s"] == 50.0
    assert format_bandwidth(s).startswith("memory bandwidth (256 MiB copies between questions, 11 samples): median 104")
