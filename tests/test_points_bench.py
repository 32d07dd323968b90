"""`domainpar bench points` end to end at a tiny size on 2 ranks: JSON, the
PNG beside it, the table; the imbalance figures (RCB balanced, equal-volume
slabs not, on clustered data) and a halo smaller than the other rank's points.
Serial (it launches its own mpiexec job); no timing is asserted."""
from test_bench import _bench


def test_bench_points_end_to_end(tmp_path):
    report, stdout, _ = _bench(tmp_path, "points", "-n", "2", "--points", "400", "--repeats", "1",
                               "-k", "4")
    assert report["ranks"] == 2 and set(report["cases"]) == {"uniform", "clustered"}
    clustered = report["cases"]["clustered"]
    imbalance = clustered["imbalance_max_over_mean"]
    assert imbalance["rcb_partition"] == 1.0 and imbalance["input_order_blocks"] == 1.0
    assert imbalance["equal_volume_slabs"] > 1.5  # 80% of the points in one small ball
    assert clustered["points_per_rank"] == [200, 200]
    for case in report["cases"].values():
        assert 0 < case["knn_halo_points_max"] < 200
        for step in ("knn", "radius_search", "model_step"):
            assert case[step]["speedup"] > 0 and len(case[step]["samples_ranks_s"]) == 1
        assert case["model_step"]["memory_ratio"] > 0
    assert "imbalance max/mean" in stdout and "load average" in stdout
