"""slurm/ddp.sbatch, submitted unchanged to a real Slurm: a controller and two slurmd "nodes" on
this machine. A two-node job, requeued mid-run, resumes from its checkpoint and completes with
the one-device weights; a failing job ends FAILED; scancel leaves nothing behind.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import JOB, REPO, free_port, load_saved, max_diff
from reference import reference_train
from conftest import FP64_TOL

DAEMONS = ["slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "srun"]
missing = [d for d in DAEMONS if shutil.which(d) is None]
pytestmark = pytest.mark.skipif(bool(missing), reason=(
    f"Slurm is not installed (no {', '.join(missing)}): apt-get install slurmctld slurmd "
    "slurm-client, as .ci/run does"))


class Cluster:
    """slurmctld and two slurmd started with -N: two "nodes", both this machine."""

    def __init__(self):
        # Unix sockets live under here: keep the path short (108 characters at most).
        self.dir = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
        # The first node must carry the real host name: it is the rendezvous host, so it must
        # resolve, and a first node named localhost matches every name ("Duplicated
        # NodeHostName").
        self.nodes = [socket.gethostname().split(".")[0], "localhost"]
        d = self.dir
        lines = [
            "ClusterName=test", f"SlurmctldHost={self.nodes[0]}(127.0.0.1)",
            f"SlurmctldPort={free_port()}", "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/none", "CredType=cred/none", "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU", "SlurmdParameters=config_overrides",
            "ReturnToService=2", "MpiDefault=none", "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none", "SchedulerParameters=sched_interval=1",
            f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool-%n",
            f"SlurmctldPidFile={d}/ctld.pid", f"SlurmdPidFile={d}/d-%n.pid",
            f"SlurmctldLogFile={d}/ctld.log", f"SlurmdLogFile={d}/d-%n.log",
            # CPUs=8 on a 2-core machine (config_overrides): two 2-node jobs can run at once.
            *[f"NodeName={n} NodeAddr=127.0.0.1 Port={free_port()} CPUs=8 State=UNKNOWN"
              for n in self.nodes],
            "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        (d / "state").mkdir()
        (d / "slurm.conf").write_text("\n".join(lines) + "\n")
        self.env = {**os.environ, "SLURM_CONF": str(d / "slurm.conf"),
                    # the job inherits this: `srun torchrun` must find this Python's torch
                    "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        self.daemons = [subprocess.Popen(cmd, env=self.env, start_new_session=True,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                        for cmd in [["slurmctld", "-D", "-i"],
                                    *[["slurmd", "-D", "-N", n] for n in self.nodes]]]
        deadline = time.monotonic() + 30
        while self.run("sinfo", "-h", "-o", "%t", check=False).stdout.split() != ["idle"]:
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail("the test cluster did not come up:\n" + self.logs())
            time.sleep(0.2)

    def run(self, *cmd, check=True):
        result = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=30)
        if check:
            assert result.returncode == 0, f"{cmd}: {result.stderr}"
        return result

    def submit(self, *args, workers_per_node=1):
        """sbatch slurm/ddp.sbatch from the repo, the log under the cluster's folder. One CPU
        worker per node unless asked: the 2-core machine runs both "nodes"."""
        result = subprocess.run(
            ["sbatch", "--parsable", f"--output={self.dir}/%j.out", "slurm/ddp.sbatch", *args],
            cwd=REPO, env={**self.env, "NPROC_PER_NODE": str(workers_per_node)},
            capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip().split(";")[0]

    def job(self, job_id):
        """scontrol's fields of a job: JobState, ExitCode, Restarts, ..."""
        text = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(f.split("=", 1) for f in text.split() if "=" in f)

    def wait(self, job_id, timeout=120, until=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")):
        """Poll (not `sbatch --wait`, which sleeps 2, 8, 32 s between looks) until the job's
        state is one of `until`; return its fields."""
        deadline = time.monotonic() + timeout
        while (fields := self.job(job_id))["JobState"] not in until:
            if time.monotonic() > deadline:
                self.run("scancel", job_id, check=False)
                pytest.fail(f"job {job_id} still {fields['JobState']} after {timeout}s:\n"
                            + self.log(job_id))
            time.sleep(0.3)
        return fields

    def log(self, job_id):
        path = self.dir / f"{job_id}.out"
        return path.read_text() if path.exists() else "(no log)"

    def logs(self):
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in self.dir.glob("*.log"))

    def stop(self):
        # Jobs first: killing slurmd does not end the job steps it started.
        self.run("scancel", "--user=root", check=False)
        for daemon in self.daemons:
            os.killpg(daemon.pid, signal.SIGTERM)
        for daemon in self.daemons:
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    yield c
    c.stop()


def processes_with(text):
    """PIDs whose command line contains `text`."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    pids.append(int(entry))
        except OSError:
            pass
    return pids


def test_two_node_job_requeued_mid_run_resumes_and_completes_with_the_one_device_weights(
        cluster, tmp_path):
    long = dict(JOB, steps=80, batch_size=60)
    flags = [*(f"--{k.replace('_', '-')}={v}" for k, v in long.items()), "--device=cpu",
             "--fp64"]
    ckpt = tmp_path / "ckpt.pt"
    job = cluster.submit(*flags, f"--checkpoint={ckpt}", "--checkpoint-every=10",
                         f"--save={tmp_path / 'w.pt'}")
    deadline = time.monotonic() + 90
    while not ckpt.exists():  # the first checkpoint: the job is mid-run
        assert time.monotonic() < deadline, cluster.log(job)
        time.sleep(0.05)
    cluster.run("scontrol", "requeue", job)
    # Once it is pending again, let it start at once: a requeued job may start only after a
    # delay (its EligibleTime moves ~2 minutes), set when the requeue completes.
    cluster.wait(job, timeout=60, until=("PENDING",))
    cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    fields = cluster.wait(job)
    log = cluster.log(job)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", log
    assert fields["Restarts"] == "1" and fields["NumNodes"] == "2", fields
    assert "ddp: 2 ranks" in log  # 2 nodes x 1 worker (NPROC_PER_NODE=1), met at the first
    assert "resumed from" in log and "(restart 1)" in log
    # 80 steps, past fp32's horizon: in float64 the requeued job is one device's uninterrupted
    # run (as test_ddp_failures.py's SIGKILL test).
    _, expected, _ = reference_train(**long, fp64=True)
    assert max_diff(load_saved(tmp_path / "w.pt"), expected) < FP64_TOL


def test_job_whose_rank_fails_ends_failed_not_hung(cluster, tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"garbage")
    job = cluster.submit("--steps=2", f"--checkpoint={bad}")
    fields = cluster.wait(job)
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] != "0:0"
    assert f"--checkpoint {bad}: cannot be read" in cluster.log(job)


def test_scancel_leaves_no_process_behind(cluster, tmp_path):
    marker = str(tmp_path / "never.pt")  # a word only this job's command lines contain
    job = cluster.submit("--steps=100000", f"--save={marker}")
    deadline = time.monotonic() + 60
    while "step     1/" not in cluster.log(job):
        assert time.monotonic() < deadline, cluster.log(job)
        time.sleep(0.1)
    assert processes_with(marker)
    cluster.run("scancel", job)
    assert cluster.wait(job)["JobState"] == "CANCELLED"
    deadline = time.monotonic() + 20
    while processes_with(marker):
        assert time.monotonic() < deadline, f"left behind: {processes_with(marker)}"
        time.sleep(0.2)
