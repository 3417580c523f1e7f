"""The environment of the MPI jobs tests start (mpirun -np N ... on a small machine): one
OpenMP/OpenBLAS thread per rank with idle threads asleep, so oversubscribed ranks share the
cores without thrashing; mpirun allowed as root and to oversubscribe; braid importable."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def mpi_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="passive", OPENBLAS_NUM_THREADS="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(REPO, "python")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env
