"""``resilient-ckpt ls | drop | status | secret``: what an operator sees and can do on a node."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from resilient_ckpt.cli import service as svc_cli
from resilient_ckpt.memory import checksum
from resilient_ckpt.memory.layout import CheckpointHeader, CheckpointId, plan_layout
from resilient_ckpt.memory.store import CheckpointStore

REPO = Path(__file__).resolve().parents[1]


def _save(
    store: CheckpointStore,
    iteration: int,
    owner: int,
    world_size: int,
    numel: int = 1000,
    replication: dict | None = None,
) -> CheckpointId:
    """One checkpoint written the way the manager writes it: reserve, claim, copy, header last."""
    t = torch.arange(numel, dtype=torch.float32) + owner
    layouts, total = plan_layout([(t.dtype, tuple(t.shape))])
    seg = store.reserve(total)
    store.claim(seg, iteration, owner)
    seg.tensor(layouts[0]).copy_(t)
    mv = checksum.byte_view(seg.buffer)
    layouts = [
        dataclasses.replace(l, checksum=checksum.digest(mv[l.offset : l.offset + l.nbytes])) for l in layouts
    ]
    header = CheckpointHeader(
        session=store.session,
        iteration=iteration,
        owner=owner,
        world_size=world_size,
        tensors=tuple(layouts),
        data_nbytes=total,
        meta=b"hollow",
        replication=replication or {},
    )
    store.publish(seg, header)
    seg.close()
    return header.id


@pytest.fixture
def root(tmp_root):
    """A node store holding two sessions.

    ``job-a`` (world size 4, this node runs ranks 0-1 and keeps replicas of 2-3): iterations 10
    and 20 complete here, iteration 30 only has owners 0-1 (replicas still missing).
    ``job-b`` (world size 2): iteration 5 with owner 0 only.
    """
    r = tmp_root / "shm"
    a = CheckpointStore(r, "job-a")
    for it in (10, 20):
        for owner in range(4):
            _save(a, it, owner, 4)
    for owner in (0, 1):
        _save(a, 30, owner, 4)
    b = CheckpointStore(r, "job-b")
    _save(b, 5, 0, 2, numel=4000)
    return r


def _run(main, argv, capsys, stdin: str | None = None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    try:
        code = main(argv)
    except SystemExit as e:  # argparse usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def _wide_terminal(monkeypatch):
    # rich wraps tables to the terminal width; a test has no terminal (80 columns).
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("RESILIENT_CKPT_ENDPOINT", raising=False)
    monkeypatch.delenv("RESILIENT_CKPT_STORE_ROOT", raising=False)


# ---- ls on a store root (no daemon) --------------------------------------------------------------


def test_ls_json_reports_sessions_iterations_owners_and_local_completeness(root, capsys):
    code, out, _ = _run(svc_cli.ls_main, ["--store-root", str(root), "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    assert doc["format"] == svc_cli.JSON_FORMAT and doc["source"] == "store"
    assert doc["root"] == str(root)
    assert doc["filesystem"]["total_bytes"] >= doc["filesystem"]["free_bytes"] > 0
    sessions = {s["session"]: s for s in doc["sessions"]}
    assert sorted(sessions) == ["job-a", "job-b"]
    a = sessions["job-a"]
    its = {i["iteration"]: i for i in a["iterations"]}
    assert sorted(its) == [10, 20, 30]
    assert its[20]["owners"] == [0, 1, 2, 3] and its[20]["complete"] and its[20]["missing_owners"] == []
    assert its[30]["owners"] == [0, 1] and not its[30]["complete"]
    assert its[30]["local_owners"] == 2 and its[30]["missing_owners"] == [2, 3]
    assert a["newest_complete"] == 20
    one = 4096  # 1000 float32 rounded up to the 256-byte alignment
    assert its[10]["data_bytes"] == 4 * one and its[30]["data_bytes"] == 2 * one
    assert a["data_bytes"] == 10 * one
    # the memory the session occupies: every file's allocated blocks (data, headers, pool)
    assert a["store_bytes"] >= a["data_bytes"] + a["free_pool_bytes"] and a["parity_bytes"] == 0
    assert its[10]["created"] and its[10]["created_ns"] > 0
    b = sessions["job-b"]
    assert b["newest_complete"] is None
    assert b["iterations"][0]["world_size"] == 2 and b["iterations"][0]["missing_owners"] == [1]


def test_ls_table_says_local_copies_of_n_of_w_owners(root, capsys):
    code, out, _ = _run(svc_cli.ls_main, ["--store-root", str(root), "--session", "job-a"], capsys)
    assert code == 0
    assert "session job-a" in out and "job-b" not in out
    assert "local copies of 4/4 owners" in out
    assert "local copies of 2/4 owners (holds 0-1)" in out
    assert "newest iteration complete here: 20" in out


def test_ls_reports_a_corrupt_header_instead_of_crashing(root, capsys):
    store = CheckpointStore(root, "job-a")
    store.header_path(CheckpointId(20, 3, "job-a")).write_bytes(b"\x93garbage")
    code, out, _ = _run(svc_cli.ls_main, ["--store-root", str(root), "--session", "job-a", "--json"], capsys)
    assert code == 0
    a = json.loads(out)["sessions"][0]
    its = {i["iteration"]: i for i in a["iterations"]}
    assert its[20]["owners"] == [0, 1, 2] and not its[20]["complete"], "a corrupt copy does not count"
    assert a["newest_complete"] == 10
    assert [p["file"] for p in a["problems"]] == ["iter_00000000000000000020.owner_000003.hdr"]
    assert "header" in a["problems"][0]["error"]


def test_ls_lists_a_checkpoint_of_another_store_format_as_unusable(root, capsys):
    """After an upgrade: old-format checkpoints are shown, never misread."""
    store = CheckpointStore(root, "job-b")
    cid = CheckpointId(5, 0, "job-b")
    h = store.read_header(cid)
    store.header_path(cid).write_bytes(dataclasses.replace(h, format_version=h.format_version + 1).pack())
    code, out, _ = _run(svc_cli.ls_main, ["--store-root", str(root), "--session", "job-b"], capsys)
    assert code == 0
    assert "unusable: iter_00000000000000000005.owner_000000.hdr" in out and "store format version" in out


def test_ls_warns_when_the_store_is_on_a_containers_64_mib_dev_shm(root, capsys, monkeypatch):
    real = os.statvfs
    blocks = (64 << 20) // 4096

    def small(path):
        st = real(path)
        return os.statvfs_result((4096, 4096, blocks, blocks // 2, blocks // 2) + tuple(st)[5:])

    monkeypatch.setattr(os, "statvfs", small)
    code, out, _ = _run(svc_cli.ls_main, ["--store-root", str(root)], capsys)
    assert code == 0
    assert "filesystem 32.0 MiB used of 64.0 MiB" in out
    assert "containers default /dev/shm to 64 MiB" in out and "--shm-size" in out
    code, out, _ = _run(svc_cli.ls_main, ["--store-root", str(root), "--json"], capsys)
    assert json.loads(out)["filesystem"] == {"total_bytes": 64 << 20, "free_bytes": 32 << 20}


def test_ls_unknown_session_names_the_sessions_present_and_exits_1(root, capsys):
    code, _, err = _run(svc_cli.ls_main, ["--store-root", str(root), "--session", "nope"], capsys)
    assert code == 1
    assert "no session 'nope'" in err and "job-a, job-b" in err


def test_ls_missing_store_root_is_a_clear_error(tmp_root, capsys):
    code, _, err = _run(svc_cli.ls_main, ["--store-root", str(tmp_root / "absent")], capsys)
    assert code == 1
    assert "no store at" in err and "--store-root" in err
    assert not (tmp_root / "absent").exists(), "ls never creates a store"


def test_ls_defaults_to_the_store_root_in_the_environment(root, capsys, monkeypatch):
    monkeypatch.setenv("RESILIENT_CKPT_STORE_ROOT", str(root))
    code, out, _ = _run(svc_cli.ls_main, ["--json"], capsys)
    assert code == 0 and json.loads(out)["root"] == str(root)


def test_store_root_and_endpoint_together_are_a_usage_error(root, capsys):
    code, _, err = _run(
        svc_cli.ls_main, ["--store-root", str(root), "--endpoint", "tcp://127.0.0.1:1"], capsys
    )
    assert code == 2 and "not allowed with" in err


# ---- drop on a store root ------------------------------------------------------------------------------


def test_drop_iteration_asks_and_a_no_keeps_everything(root, capsys, monkeypatch):
    before = CheckpointStore(root, "job-a").list()
    code, _, err = _run(
        svc_cli.drop_main,
        ["--store-root", str(root), "--session", "job-a", "--iteration", "20"],
        capsys,
        stdin="n\n",
        monkeypatch=monkeypatch,
    )
    assert code == 1
    assert "Drop iteration(s) 20 of session 'job-a'" in err and "[y/N]" in err
    assert "newest complete" in err and "fall back to iteration 10" in err
    assert "nothing was dropped" in err
    assert CheckpointStore(root, "job-a").list() == before


def test_drop_without_an_answer_on_stdin_drops_nothing_and_points_at_yes(root, capsys, monkeypatch):
    code, _, err = _run(
        svc_cli.drop_main,
        ["--store-root", str(root), "--session", "job-b", "--all"],
        capsys,
        stdin="",
        monkeypatch=monkeypatch,
    )
    assert code == 1 and "--yes" in err
    assert CheckpointStore(root, "job-b").list()


def test_drop_iteration_confirmed_removes_every_owner_and_releases_memory(root, capsys, monkeypatch):
    store = CheckpointStore(root, "job-a")
    code, out, _ = _run(
        svc_cli.drop_main,
        ["--store-root", str(root), "--session", "job-a", "--iteration", "10", "--json"],
        capsys,
        stdin="y\n",
        monkeypatch=monkeypatch,
    )
    assert code == 0
    doc = json.loads(out)
    assert doc["dropped"] == [{"iteration": 10, "owner": o} for o in range(4)]
    assert doc["released_bytes"] == 4 * 4096 and not doc["whole_session"]
    assert [c.iteration for c in store.list()] == [20] * 4 + [30] * 2
    assert not any(store.data_path(CheckpointId(10, o, "job-a")).exists() for o in range(4))
    assert store.usage()["free_pool_bytes"] == 0, "dropped bytes are released, not pooled"


def test_drop_several_iterations_with_yes_does_not_ask(root, capsys):
    code, out, err = _run(
        svc_cli.drop_main,
        ["--store-root", str(root), "--session", "job-a", "--iteration", "10", "--iteration", "30", "--yes"],
        capsys,
    )
    assert code == 0 and "[y/N]" not in err
    assert "dropped iteration(s) 10,30 of session 'job-a': 6 checkpoint(s)" in out
    assert sorted({c.iteration for c in CheckpointStore(root, "job-a").list()}) == [20]


def test_drop_of_an_iteration_not_held_drops_nothing_and_says_what_is_held(root, capsys):
    code, _, err = _run(
        svc_cli.drop_main,
        ["--store-root", str(root), "--session", "job-a", "--iteration", "20", "--iteration", "99", "--yes"],
        capsys,
    )
    assert code == 1
    assert "no iteration 99" in err and "10,20,30" in err and "nothing was dropped" in err
    assert len(CheckpointStore(root, "job-a").list()) == 10


def test_drop_all_removes_the_session_directory_and_leaves_other_sessions(root, capsys):
    code, out, _ = _run(
        svc_cli.drop_main, ["--store-root", str(root), "--session", "job-a", "--all", "-y"], capsys
    )
    assert code == 0 and "dropped session 'job-a'" in out
    assert not (root / "job-a").exists()
    assert svc_cli.session_names(root) == ["job-b"]


def test_drop_removes_every_header_before_any_data_file(root, monkeypatch):
    """An interrupted drop never leaves a header whose data is gone (a checkpoint that lies)."""
    events = []
    real_unlink = Path.unlink

    def spy(self, *a, **kw):
        out = real_unlink(self, *a, **kw)
        if self.suffix in (".hdr", ".data"):  # only files actually removed
            events.append(self.suffix)
        return out

    monkeypatch.setattr(Path, "unlink", spy)
    res = svc_cli.drop_iterations(root, "job-a", [10, 20])
    assert len(res.dropped) == 8
    assert events == [".hdr"] * 8 + [".data"] * 8


def test_drop_needs_an_iteration_or_all(root, capsys):
    code, _, err = _run(svc_cli.drop_main, ["--store-root", str(root), "--session", "job-a"], capsys)
    assert code == 2 and "--iteration" in err and "--all" in err


def test_owner_ranges_stay_short_for_large_jobs():
    assert svc_cli.ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert svc_cli.ranges(list(range(1024))) == "0-1023"
    assert svc_cli.ranges([]) == "-"


# ---- secret ----------------------------------------------------------------------------------------------


def test_secret_writes_a_0600_file_the_daemon_accepts_and_refuses_to_overwrite(tmp_root, capsys):
    from resilient_ckpt.service.wire.auth import load_secret

    path = tmp_root / "job.secret"
    code, out, _ = _run(svc_cli.secret_main, [str(path)], capsys)
    assert code == 0 and "mode 0600" in out
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    first = load_secret(path)
    assert len(first) == 64
    code, _, err = _run(svc_cli.secret_main, [str(path)], capsys)
    assert code == 1 and "--force" in err and load_secret(path) == first
    assert _run(svc_cli.secret_main, [str(path), "--force"], capsys)[0] == 0
    assert load_secret(path) != first


def test_derived_secrets_agree_for_one_label_and_differ_between_labels(tmp_root, capsys):
    from resilient_ckpt.service.wire.auth import load_secret

    key = tmp_root / "cluster.key"
    assert _run(svc_cli.secret_main, [str(key)], capsys)[0] == 0
    files = {}
    for name, label in (("a", "slurm-7"), ("b", "slurm-7"), ("c", "slurm-8")):
        files[name] = tmp_root / f"{name}.secret"
        code, out, _ = _run(
            svc_cli.secret_main, [str(files[name]), "--derive-from", str(key), "--label", label], capsys
        )
        assert code == 0 and f"derived for {label!r}" in out
        assert stat.S_IMODE(files[name].stat().st_mode) == 0o600
    assert load_secret(files["a"]) == load_secret(files["b"]) != load_secret(files["c"])
    assert load_secret(files["a"]) != load_secret(key), "the job secret is not the cluster key"
    code, _, err = _run(svc_cli.secret_main, [str(tmp_root / "d"), "--derive-from", str(key)], capsys)
    assert code == 2 and "--label" in err
    key.chmod(0o644)
    code, _, err = _run(
        svc_cli.secret_main, [str(tmp_root / "e"), "--derive-from", str(key), "--label", "x"], capsys
    )
    assert code == 1 and "chmod 600" in err and not (tmp_root / "e").exists()


# ---- the installed entry point ------------------------------------------------------------------------


def test_commands_are_registered_in_the_resilient_ckpt_entry_point(root):
    env = dict(os.environ, COLUMNS="200")
    env.pop("RESILIENT_CKPT_ENDPOINT", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilient_ckpt.cli.main",
            "ls",
            "--store-root",
            str(root),
            "--session",
            "job-b",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "local copies of 1/2 owners" in proc.stdout
    helptext = subprocess.run(
        [sys.executable, "-m", "resilient_ckpt.cli.main", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    for name in ("ls", "drop", "status", "secret"):
        assert f"    {name} " in helptext or f"\n    {name}\n" in helptext, helptext


# ---- through a live daemon ---------------------------------------------------------------------------

SECRET = "cli-test-secret-0123456789abcdef"
# A 2-node job, one rank per node, every rank's data copied to the other node.
RING = {"kind": "ring", "factor": 2, "jump": 1, "ranks_per_node": 1}


@pytest.fixture
def cluster(tmp_root, monkeypatch):
    """Two in-process daemons (nodes 0 and 1) that know each other.

    Node 1 holds iteration 7 of both ranks (its own and node 0's replica); node 0 is a
    replacement node whose store is empty.
    """
    from harness import free_port
    from resilient_ckpt.service.daemon import Daemon, DaemonConfig
    from resilient_ckpt.service.wire.auth import Authenticator

    monkeypatch.setenv("RESILIENT_CKPT_SECRET", SECRET)
    monkeypatch.delenv("RESILIENT_CKPT_SECRET_FILE", raising=False)
    roots = [tmp_root / "node0", tmp_root / "node1"]
    s1 = CheckpointStore(roots[1], "job")
    for owner in (0, 1):
        _save(s1, 7, owner, 2, numel=300_000, replication=RING)
    peers = {n: f"tcp://127.0.0.1:{free_port()}" for n in (0, 1)}
    auth = Authenticator(SECRET.encode())
    daemons = [
        Daemon(
            DaemonConfig(
                store_root=str(roots[n]),
                bind=peers[n],
                node_id=n,
                peers=peers,
                ping_interval_s=0.2,
                keep_last=None,
            ),
            auth,
        ).start()
        for n in (0, 1)
    ]
    yield peers, roots
    for d in daemons:
        d.stop()


def _status_json(endpoint, capsys):
    code, out, err = _run(svc_cli.status_main, ["--endpoint", endpoint, "--json"], capsys)
    assert code == 0, err
    return json.loads(out)


def _wait_for(predicate, what, timeout=15.0):
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_status_shows_node_version_store_peers_in_flight_and_rejects(cluster, capsys):
    import resilient_ckpt
    from resilient_ckpt.service.client import DaemonClient
    from resilient_ckpt.service.wire import PROTOCOL_VERSION, PeerTimeout
    from resilient_ckpt.service.wire.auth import Authenticator

    peers, roots = cluster
    _wait_for(
        lambda: _status_json(peers[1], capsys)["daemon"]["peers"][0]["reachable"], "node 1 to see node 0"
    )
    # A process without the job secret: the daemon drops its message unanswered and counts it.
    with DaemonClient(
        peers[1], "job", Authenticator(b"not-the-job-secret-at-all"), timeout_s=0.3, retries=0
    ) as c:
        with pytest.raises(PeerTimeout):
            c.status()
    doc = _status_json(peers[1], capsys)
    d = doc["daemon"]
    assert d["node_id"] == 1 and d["version"] == resilient_ckpt.__version__
    assert d["protocol_version"] == PROTOCOL_VERSION
    assert d["store"]["root"] == str(roots[1]) and d["store"]["checkpoints"] == 2
    assert doc["filesystem"]["total_bytes"] >= doc["filesystem"]["free_bytes"] > 0
    assert d["rejected"] == {"auth": 1}

    code, out, _ = _run(svc_cli.status_main, ["--endpoint", peers[1]], capsys)
    assert code == 0
    assert (
        "daemon node 1 at" in out
        and f"resilient_ckpt {resilient_ckpt.__version__}, protocol {PROTOCOL_VERSION}" in out
    )
    assert "in 2 checkpoint(s)" in out and "filesystem:" in out and "free)" in out
    assert "peers reachable: 1/1" in out
    assert "in flight: 0 replication(s) out" in out
    assert "rejected messages: auth 1" in out


def test_status_of_an_unreachable_daemon_is_one_line_and_exit_code_2(capsys, monkeypatch):
    from harness import free_port

    monkeypatch.setenv("RESILIENT_CKPT_SECRET", SECRET)
    code, out, err = _run(
        svc_cli.status_main, ["--endpoint", f"tcp://127.0.0.1:{free_port()}", "--timeout", "0.3"], capsys
    )
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(
        "resilient-ckpt: error: no answer from a daemon at tcp://127.0.0.1:"
    )
    assert "secret" in err


def test_status_without_a_job_secret_exits_2_and_says_how_to_provide_one(capsys, monkeypatch):
    monkeypatch.delenv("RESILIENT_CKPT_SECRET", raising=False)
    monkeypatch.delenv("RESILIENT_CKPT_SECRET_FILE", raising=False)
    code, _, err = _run(svc_cli.status_main, ["--endpoint", "tcp://127.0.0.1:1"], capsys)
    assert code == 2 and "RESILIENT_CKPT_SECRET_FILE" in err


def test_ls_through_a_daemon_shows_this_node_and_with_peers_the_whole_job(cluster, capsys):
    peers, _ = cluster
    code, out, _ = _run(svc_cli.ls_main, ["--endpoint", peers[1], "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    assert doc["source"] == "daemon" and doc["node_id"] == 1
    (job,) = doc["sessions"]
    assert job["iterations"][0]["owners"] == [0, 1] and job["iterations"][0]["complete"]
    assert "job" not in job, "only with --peers"

    code, out, _ = _run(
        svc_cli.ls_main, ["--endpoint", peers[0], "--session", "job", "--peers", "--json"], capsys
    )
    assert code == 0
    (job,) = json.loads(out)["sessions"]
    assert job["iterations"] == [], "node 0 holds nothing itself"
    assert job["job"]["complete_iterations"] == [7]
    assert job["job"]["holders"] == [
        {"iteration": 7, "owner": 0, "nodes": [1]},
        {"iteration": 7, "owner": 1, "nodes": [1]},
    ]

    code, out, _ = _run(svc_cli.ls_main, ["--endpoint", peers[0], "--peers"], capsys)
    assert code == 0 and "iteration 7: rank 0 on node(s) 1; rank 1 on node(s) 1" in out


def test_pull_brings_this_nodes_ranks_from_a_peer_with_a_progress_bar(cluster, capsys, monkeypatch):
    peers, roots = cluster
    monkeypatch.setenv("FORCE_COLOR", "1")  # the progress bar is drawn for terminals only
    code, out, err = _run(svc_cli.pull_main, ["--endpoint", peers[0], "--session", "job"], capsys)
    assert code == 0, err
    assert "iteration 7" in err, "progress bar"
    assert "node 0 now holds ranks 0 of iteration 7 of session 'job'" in out
    store = CheckpointStore(roots[0], "job")
    assert store.list() == [CheckpointId(7, 0, "job")], "only node 0's own rank is pulled"
    assert store.open(CheckpointId(7, 0, "job")).verify() == []
    monkeypatch.delenv("FORCE_COLOR")
    code, out, _ = _run(svc_cli.pull_main, ["--endpoint", peers[0], "--session", "job", "--json"], capsys)
    assert code == 0 and json.loads(out)["pulled"] == [], "nothing left to pull"


def test_pull_of_a_checkpoint_nobody_holds_fails_with_exit_code_1(cluster, capsys):
    peers, _ = cluster
    code, _, err = _run(
        svc_cli.pull_main,
        ["--endpoint", peers[0], "--session", "job", "--iteration", "99", "--owner", "0"],
        capsys,
    )
    assert code == 1 and "rank 0 of iteration 99" in err


def test_drop_through_a_daemon_asks_then_retires_its_copies_only(cluster, capsys, monkeypatch):
    peers, roots = cluster
    args = ["--endpoint", peers[1], "--session", "job", "--iteration", "7"]
    code, _, err = _run(svc_cli.drop_main, args, capsys, stdin="no\n", monkeypatch=monkeypatch)
    assert code == 1 and "[y/N]" in err and len(CheckpointStore(roots[1], "job").list()) == 2
    code, out, _ = _run(svc_cli.drop_main, args + ["--json"], capsys, stdin="y\n", monkeypatch=monkeypatch)
    assert code == 0
    doc = json.loads(out)
    assert doc["dropped_by_daemon"] == 2 and doc["dropped"] == [
        {"iteration": 7, "owner": 0},
        {"iteration": 7, "owner": 1},
    ]
    assert CheckpointStore(roots[1], "job").list() == []


def test_serve_runs_a_daemon_that_status_reaches_and_sigterm_stops(tmp_root):
    """The entry point the systemd unit, the DaemonSet and the Slurm prolog run."""
    import signal

    from harness import free_port

    secret = tmp_root / "job.secret"
    assert svc_cli.secret_main([str(secret)]) == 0
    port = free_port()
    env = dict(os.environ, RESILIENT_CKPT_SECRET_FILE=str(secret), COLUMNS="200")
    env.pop("RESILIENT_CKPT_SECRET", None)
    daemon = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "resilient_ckpt.cli.main",
            "serve",
            "--store-root",
            str(tmp_root / "shm"),
            "--bind",
            f"tcp://127.0.0.1:{port}",
            "--node-id",
            "3",
            "--log-format",
            "json",
        ],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        status = [
            sys.executable,
            "-m",
            "resilient_ckpt.cli.main",
            "status",
            "--endpoint",
            f"tcp://127.0.0.1:{port}",
        ]
        for _ in range(30):  # the daemon imports torch first: give it a few seconds
            proc = subprocess.run(
                status + ["--json", "--timeout", "1"], env=env, capture_output=True, text=True, timeout=60
            )
            if proc.returncode != 2:
                break
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["daemon"]["node_id"] == 3
    finally:
        daemon.send_signal(signal.SIGTERM)
        _, log = daemon.communicate(timeout=30)
    assert daemon.returncode == 0, log
    events = [json.loads(line)["event"] for line in log.splitlines() if line.startswith("{")]
    assert "stopping" in events
