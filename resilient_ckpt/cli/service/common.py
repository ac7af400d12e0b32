"""What the ``resilient-ckpt status | ls | drop | pull | secret`` commands share: exit codes,
formatting helpers, argument plumbing, confirmation, and talking to a daemon."""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import sys
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from rich.console import Console

from ...errors import CheckpointingException
from ...memory.store import DEFAULT_ROOT
from ...service.client import DaemonClient, DaemonError
from ...service.wire import PeerTimeout, PeerUnreachable, ProtocolConfigError, authenticator_from_env

#: Bump when a key of the ``--json`` documents changes meaning or disappears.
JSON_FORMAT = 1
EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2
STORE_ROOT_ENV = "RESILIENT_CKPT_STORE_ROOT"
ENDPOINT_ENV = "RESILIENT_CKPT_ENDPOINT"


# ---- formatting helpers --------------------------------------------------------------------------


def human_bytes(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def ranges(values: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"`` (owner lists of large jobs stay short)."""
    out = []
    vals = sorted(set(values))
    i = 0
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        out.append(str(vals[i]) if i == j else f"{vals[i]}-{vals[j]}")
        i = j + 1
    return ",".join(out) or "-"


def iso(ns: int) -> Optional[str]:
    if not ns:
        return None
    return _dt.datetime.fromtimestamp(ns / 1e9).astimezone().isoformat(timespec="seconds")


def console(stderr: bool = False) -> Console:
    return Console(file=sys.stderr if stderr else sys.stdout, highlight=False)


def fail(msg: str, code: int = EXIT_PROBLEM) -> int:
    print(f"resilient-ckpt: error: {msg}", file=sys.stderr)
    return code


def print_json(doc: Dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc, indent=1, sort_keys=False) + "\n")


# ---- argument plumbing shared by the commands -------------------------------------------------------


def add_daemon_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--secret-file", help="the job secret for a daemon (default $RESILIENT_CKPT_SECRET_FILE)")
    p.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for a daemon's answer (default 5)"
    )
    p.add_argument("--json", action="store_true", help="one JSON document on stdout, for scripts")


def add_target(p: argparse.ArgumentParser, daemon_help: str) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--store-root",
        help=f"read/modify the store directly, no daemon needed (default ${STORE_ROOT_ENV} or "
        "/dev/shm/resilient_ckpt)",
    )
    g.add_argument("--endpoint", help=daemon_help + f" (default ${ENDPOINT_ENV})")
    add_daemon_options(p)


def target(args: argparse.Namespace) -> Tuple[str, str]:
    """("daemon", endpoint) or ("store", root): an explicit flag wins over the environment."""
    if args.store_root:
        return "store", args.store_root
    if args.endpoint:
        return "daemon", args.endpoint
    if os.environ.get(ENDPOINT_ENV):
        return "daemon", os.environ[ENDPOINT_ENV]
    return "store", os.environ.get(STORE_ROOT_ENV) or DEFAULT_ROOT


def confirm(question: str, assume_yes: bool) -> bool:
    """Ask on the terminal; no answer (EOF, e.g. stdin not a terminal) means no."""
    if assume_yes:
        return True
    sys.stderr.write(f"{question} [y/N] ")
    sys.stderr.flush()
    try:
        answer = sys.stdin.readline()
    except (OSError, ValueError):
        answer = ""
    if not answer:
        sys.stderr.write("\n")
        print("resilient-ckpt: no answer on stdin; pass --yes to drop without asking", file=sys.stderr)
        return False
    return answer.strip().lower() in ("y", "yes")


# ---- talking to a daemon --------------------------------------------------------------------------


class CommandExit(Exception):
    """Ends a command with an exit code and a one-line message on stderr."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


@contextlib.contextmanager
def daemon_errors(endpoint: str, timeout: float):
    """Turn a daemon conversation's failures into one clear line and an exit code."""
    try:
        yield
    except (PeerTimeout, PeerUnreachable) as e:
        skew = getattr(e, "clock_skew_s", None)
        raise CommandExit(
            EXIT_USAGE,
            f"no answer from a daemon at {endpoint} within {timeout:g} s: it is not running there, "
            "or it does not use this job's secret (it drops messages it cannot authenticate without "
            "answering). Check the daemon (systemctl status resilient-ckpt, kubectl logs, the Slurm "
            f"prolog log), the endpoint, and --secret-file ({type(e).__name__})"
            + (
                ""
                if skew is None
                else f". Also, an answer came back timestamped {skew:+.1f} s from this host's clock: synchronise "
                "clocks (NTP/chrony), a skew beyond the replay window makes each side drop the other's messages"
            ),
        ) from None
    except ProtocolConfigError as e:  # no or unusable secret, bad endpoint
        raise CommandExit(EXIT_USAGE, str(e)) from None
    except DaemonError as e:
        hint = ""
        if getattr(e, "code", None) is not None and e.code.value == "WRONG_SESSION":
            hint = "; pass --session with a session the daemon serves (its --session list)"
        raise CommandExit(EXIT_PROBLEM, f"the daemon at {endpoint} refused: {e}{hint}") from None
    except CheckpointingException as e:
        raise CommandExit(EXIT_PROBLEM, str(e)) from None


def client(endpoint: str, session: str, args: argparse.Namespace) -> DaemonClient:
    # Operator commands ask once: a retry would only double the wait for an absent daemon.
    return DaemonClient(
        endpoint, session, authenticator_from_env(args.secret_file), timeout_s=args.timeout, retries=0
    )


#: DaemonClient needs a session; STATUS does not look at it. Any plain name passes the
#: daemon's check unless it serves an explicit --session list (then pass one of them).
ANY_SESSION = "-"


def fs_usage(status: Mapping[str, Any]) -> Optional[Dict[str, int]]:
    """The store filesystem's size: from the daemon if it says, else read here when the
    daemon's store root is visible on this machine (the usual case: status on the node)."""
    store = status.get("store") or {}
    if "fs_total_bytes" in store and "fs_free_bytes" in store:
        return {"total_bytes": int(store["fs_total_bytes"]), "free_bytes": int(store["fs_free_bytes"])}
    root = store.get("root")
    if not root:
        return None
    try:
        st = os.statvfs(root)
    except OSError:
        return None
    return {"total_bytes": st.f_blocks * st.f_frsize, "free_bytes": st.f_bavail * st.f_frsize}


def duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    parts = [f"{d}d"] * bool(d) + [f"{h}h"] * bool(h) + [f"{m}m"] * bool(m)
    return " ".join(parts + [f"{s}s"]) if not d else " ".join(parts)
