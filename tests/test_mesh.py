"""Rank arithmetic of the mesh and the layouts that must be refused (no processes needed)."""

import pytest

from meshtron.config import load_config
from meshtron.errors import MeshtronError
from meshtron.parallel.mesh import MeshLayout, ParallelMesh
from meshtron.plan import check_run


def test_rank_order_is_tp_cp_dp_pp():
    layout = MeshLayout(world_size=16, tp=2, cp=2, pp=2)
    assert layout.dp == 2
    assert layout.coords(0) == {"tp": 0, "cp": 0, "dp": 0, "pp": 0}
    assert layout.coords(1) == {"tp": 1, "cp": 0, "dp": 0, "pp": 0}
    assert layout.coords(2) == {"tp": 0, "cp": 1, "dp": 0, "pp": 0}
    assert layout.coords(4) == {"tp": 0, "cp": 0, "dp": 1, "pp": 0}
    assert layout.coords(8) == {"tp": 0, "cp": 0, "dp": 0, "pp": 1}
    for rank in range(16):
        assert layout.rank_of(layout.coords(rank)) == rank


def test_groups_partition_the_world():
    layout = MeshLayout(world_size=16, tp=2, cp=2, pp=2)
    assert layout.groups(("tp",))[:2] == [[0, 1], [2, 3]]
    assert layout.groups(("pp",))[0] == [0, 8]
    assert layout.groups(("dp",))[0] == [0, 4]
    assert layout.groups(("dp", "cp"))[0] == [0, 2, 4, 6]
    for axes in [("tp",), ("cp",), ("dp",), ("pp",), ("dp", "cp"), ("tp", "pp")]:
        groups = layout.groups(axes)
        assert sorted(r for g in groups for r in g) == list(range(16))


def test_expert_groups_fold_into_dp_times_cp():
    layout = MeshLayout(world_size=8, tp=1, cp=1, pp=1, ep=4)
    ep, edp = layout.expert_groups()
    assert ep == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert edp == [[0, 4], [1, 5], [2, 6], [3, 7]]
    layout = MeshLayout(world_size=8, tp=2, cp=1, pp=1, ep=2)  # dp=4 inside each tp slice
    ep, edp = layout.expert_groups()
    assert [0, 2] in ep and [4, 6] in ep and [0, 4] in edp


def test_whole_experts_fold_ep_over_tp_too():
    ep, edp = MeshLayout(world_size=8, tp=2, ep=4, etp=1).expert_groups()  # tp x dp = 2 x 4
    assert ep == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert edp == [[0, 4], [1, 5], [2, 6], [3, 7]]
    ep, edp = MeshLayout(world_size=8, tp=2, pp=2, ep=2, etp=1).expert_groups()
    assert ep == [[0, 1], [2, 3], [4, 5], [6, 7]]  # never across pipeline stages
    assert edp == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_single_process_mesh_has_no_process_groups():
    mesh = ParallelMesh.single()
    for name in ("tp", "cp", "dp", "pp", "dp_cp", "model", "world", "ep", "edp"):
        group = getattr(mesh, name)
        assert group.pg is None and group.size == 1 and group.rank == 0


@pytest.mark.parametrize(
    ("world", "overrides", "message"),
    [
        (6, ["--parallel.tp=4"], "world size 6 is not divisible by tp*cp*pp = 4*1*1 = 4"),
        (3, ["--parallel.tp=3"], "parallel.tp=3 does not divide model.num_heads=8"),
        (8, ["--parallel.tp=8", "--model.num_kv_heads=4", "--model.num_heads=24",
             "--model.hidden_size=384", "--model.num_kv_heads=3"],
         "parallel.tp=8 and model.num_kv_heads=3: one must divide the other"),
        (2, ["--parallel.tp=2", "--model.vocab_size=300", "--model.vocab_multiple=127"],
         "parallel.tp=2 does not divide the padded vocabulary of 381"),
        (2, ["--parallel.tp=2", "--parallel.sp=true", "--train.seq_len=33"],
         "parallel.sp needs train.seq_len=33 divisible by parallel.tp=2"),
        (2, ["--parallel.tp=2", "--parallel.tp_comm_overlap=true"],
         "parallel.tp_comm_overlap overlaps the sequence-parallel all-gathers"),
        (2, ["--parallel.tp=2", "--parallel.sp=true", "--parallel.tp_comm_overlap=true",
             "--train.seq_len=36", "--parallel.tp_comm_chunks=4"],
         "parallel.tp_comm_chunks=4 does not divide the 18 positions"),
        (2, ["--parallel.tp=2", "--parallel.sp=true", "--parallel.tp_comm_overlap=true",
             "--parallel.tp_comm_chunks=0"],
         "parallel.tp_comm_chunks must be a positive integer, got 0"),
        (4, ["--parallel.tp=2", "--parallel.pp=2", "--parallel.sp=true", "--model.num_layers=2",
             "--parallel.tp_comm_overlap=true", "--parallel.schedule=zb-h1"],
         "parallel.tp_comm_overlap does not combine with parallel.schedule=zb-h1"),
        (2, ["--parallel.tp=2", "--parallel.sp=true", "--parallel.tp_comm_overlap=true",
             "--precision.fp8=tensorwise"], "does not combine with precision.fp8=tensorwise"),
        (1, ["--model.dropout=0.1", "--train.compile=true"],
         "train.compile needs model.dropout=0 (got 0.1)"),
        (4, ["--parallel.tp=1", "--train.global_batch=6"],
         "train.global_batch=6 is not divisible by the data-parallel size 4"),
        (4, ["--parallel.tp=2", "--train.global_batch=12", "--train.micro_batch=4"],
         "is not a multiple of train.micro_batch=4 x data-parallel size 2"),
        (2, ["--parallel.ep=4"], "parallel.ep=4 does not divide dp*cp"),
    ],
)
def test_impossible_layouts_are_refused_in_one_line(world, overrides, message):
    with pytest.raises(MeshtronError) as err:  # from the field's own check or the plan's
        check_run(load_config(overrides=overrides), world)
    assert message in str(err.value) and "\n" not in str(err.value)
