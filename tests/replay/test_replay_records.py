"""``kv-canary replay`` and ``--inject``: the canary end to end over the replay (host, reference backend)."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
from helpers import naive_records as naive

import canary.replay.engine
import canary.replay.replay
import canary.replay.replay_manager
from canary.replay import cli
from canary.replay.engine import _splitmix64, kv_bytes, token_of
from canary.replay.faults import KINDS, OFFLOAD_KINDS, PD_KINDS, RANK_KINDS
from canary import splitmix64  # the public hash

M64 = (1 << 64) - 1

# Small runs: rows are reused (8 of them for 12 requests), so stale-row faults have a finished request's slots.
SMALL = ["replay", "--backend", "reference", "--max-requests", "12", "--max-batch-size", "8", "--chunk-size", "512"]


def _small(extra) -> list[str]:
    """SMALL, less its --max-requests when ``extra`` gives one (an option given twice is refused)."""
    if "--max-requests" not in extra:
        return SMALL
    i = SMALL.index("--max-requests")
    return SMALL[:i] + SMALL[i + 2:]


def _replay(tmp_path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "summary.json"
    rc = cli.main([*_small(extra), *extra, "--json", str(out)])
    return rc, json.loads(out.read_text())


def _refused(capsys, *extra: str) -> str:
    """``kv-canary replay SMALL EXTRA`` refused before the run (exit 2, nothing on stdout): its message."""
    with pytest.raises(SystemExit) as exc:
        cli.main([*_small(extra), *extra])
    captured = capsys.readouterr()
    assert exc.value.code == 2 and captured.out == "", captured
    return captured.err.strip().splitlines()[-1]


def test_xp_content_matches_the_package_hashes():
    x = np.arange(-50, 5000, 7, dtype=np.int64)
    assert np.array_equal(_splitmix64(x, np), splitmix64(x))


# (request, position, splitmix64(request << 32 | position) as an unsigned 64-bit int, its low 15 bits): worked
# out once with the pure-Python tests/helpers/naive_records.splitmix64 and frozen here.
TOKEN_VECTORS = [
    (0, 0, 0x0000000000000000, 0),
    (0, 1, 0x5692161D100B05E5, 1509),
    (1, 0, 0xD820B7E910B0F93F, 31039),
    (3, 5, 0x6DEC7181156CD6C8, 22216),
    (7, 1000, 0xAA083087D5A8F21C, 29212),
    (123456, 4095, 0x132270C306C2BD6F, 15727),
]


@pytest.mark.parametrize("req,pos,mixed,token", TOKEN_VECTORS)
def test_token_of_is_the_low_15_bits_of_splitmix64(req, pos, mixed, token):
    assert mixed & 0x7FFF == token  # the table is self-consistent
    assert naive.splitmix64((req << 32) | pos) == mixed  # ... and right
    assert int(splitmix64((req << 32) | pos)) & M64 == mixed  # the library's public hash
    assert int(token_of(req, pos)) == token


def test_token_of_vectorized():
    req, pos, _, tokens = (list(col) for col in zip(*TOKEN_VECTORS))
    got = token_of(np.array(req), np.array(pos))
    assert got.tolist() == tokens


def test_kv_bytes_are_little_endian_splitmix64_words_of_the_key():
    """canary/replay/engine.py: token (r, p) has the key ``(r << 24 | p) * 16``; its 96 KV bytes are the 12 words
    ``splitmix64(key + j)``, j = 0..11, each as 8 little-endian bytes (K: words 0-3, V: words 4-11)."""
    pairs = [(1, 3), (2, 4), (0, 0), (300, 65535)]
    got = kv_bytes(np.array([r for r, _ in pairs]), np.array([p for _, p in pairs]))
    assert got.dtype == np.uint8 and got.shape == (len(pairs), 96)
    for row, (r, p) in zip(got, pairs):
        key = ((r << 24) | p) * 16
        want = b"".join(naive.splitmix64(key + j).to_bytes(8, "little") for j in range(12))
        assert row.tobytes() == want, (r, p)
    # Frozen: (1, 3) has key 0x10000030; splitmix64 of it is 0x9A10F8845795A6AF and of key + 1 0x633E3263CCC9283F.
    assert got[0, :16].tobytes().hex() == "afa6955784f8109a3f28c9cc63323e63"
    assert not got[2, :8].any()  # key 0: splitmix64(0) == 0


def test_clean_canary_run(tmp_path, capsys):
    rc, s = _replay(tmp_path, "--check-every", "5")
    text = capsys.readouterr().out
    assert rc == 0, text
    c = s["canary"]
    assert c["violations"] == c["dropped"] == c["unattributed_violations"] == 0 and not c["failed"]
    assert c["faults"] == [] and c["drain_every_steps"] == 1 and c["real_kv_mode"] == "ALL"
    h = c["health"]
    assert h["verify_launches"] == h["write_launches"] == s["steps"] > 100
    assert h["verify_slots"] > h["write_slots"] > 0
    assert set(c["time_us"]) == {"p50", "p99", "max"}
    assert s["mismatches"] == 0 and s["checked_steps"] > 0  # the reference plans with the same expected-token pool
    assert "canary violations (unattributed)" in text and "injected faults" not in text


def test_clean_canary_run_sliding_window(tmp_path):
    rc, s = _replay(tmp_path, "--swa-window", "128", "--check-every", "7")
    assert rc == 0 and s["canary"]["violations"] == 0 and s["mismatches"] == 0


# Per kind: the kernels and reasons at the first detection step, the delay, and reasons seen later.
EXPECTED = {
    "kv-flip": (["verify"], {"REAL_KV"}, 1, {"REAL_KV"}),
    "overwrite": (["write", "verify"], {"CHAIN"}, 1, {"CHAIN"}),
    "position": (["write"], {"WRITE_POSITION"}, 0, {"POSITION"}),
    # Through the manager the write has no token assert (an engine has no truth beyond what it fed the forward):
    # the next verify reads the record against the request's accepted token.
    "token": (["verify"], {"VERIFY_TOKEN"}, 1, {"VERIFY_TOKEN"}),
    "stale-row": (["verify"], {"CHAIN"}, 1, {"CHAIN"}),
    # An all-zero record and all-zero KV: the real-KV fold of zero bytes is never the unwritten 0.
    "zero-kv": (["verify"], {"REAL_KV", "CHAIN", "POSITION"}, 1, {"REAL_KV"}),
    # The plan gives the position MISSING_SLOT: nothing is read, its successor's chain check is skipped.
    "swa-evict": (["verify"], {"MISSING"}, 1, {"MISSING"}),
    # Self-consistent records: only the expected-token pool (accepted tokens, keyed by request) sees them.
    "spec-reject": (["verify"], {"VERIFY_TOKEN"}, 1, {"VERIFY_TOKEN"}),
    "row-recycle": (["verify"], {"VERIFY_TOKEN"}, 1, {"VERIFY_TOKEN"}),
    # Only the layer rotation reads the last layer: found when the cursor reaches it (delay 1 to --num-layers).
    "kv-flip-last": (["verify_layer"], {"REAL_KV"}, None, {"REAL_KV"}),
    # At a restore from the host tier, before the step's plan: its own verify reads the restored prefix.
    "offload-stale": (["verify"], {"VERIFY_TOKEN", "CHAIN"}, 0, {"VERIFY_TOKEN"}),
    "offload-swap": (["verify"], {"POSITION", "CHAIN"}, 0, {"POSITION"}),
    "offload-partial": (["write", "verify"], {"POSITION", "WRITE_POSITION"}, 0, {"POSITION"}),
    "offload-foreign": (["verify"], {"REAL_KV"}, 0, {"REAL_KV"}),
}
SWA_ONLY = {"swa-evict"}  # kinds that need --swa-window
SWA = ["--swa-window", "256"]
LAYERS_ONLY = {"kv-flip-last"}  # kinds that need --num-layers >= 2
LAYERS = ["--num-layers", "3"]
OFFLOAD_ONLY = set(OFFLOAD_KINDS)  # kinds that need --offload-tier (refused with --swa-window)
OFFLOAD = ["--offload-tier", "8192"]


# pd-*, rank-*: tests/replay/test_replay_pd.py, test_replay_ranks.py
@pytest.mark.parametrize("kind", [k for k in KINDS if k not in PD_KINDS + RANK_KINDS])
def test_each_fault_is_detected(tmp_path, capsys, kind):
    rc, s = _replay(tmp_path, "--inject", f"{kind}@20", *(SWA if kind in SWA_ONLY else []),
                    *(LAYERS if kind in LAYERS_ONLY else []), *(OFFLOAD if kind in OFFLOAD_ONLY else []))
    text = capsys.readouterr().out
    assert rc == 0, text
    c = s["canary"]
    (f,) = c["faults"]
    kernels, reasons, delay, later = EXPECTED[kind]
    assert f["kind"] == kind and f["requested_step"] == 20 and f["applied_step"] >= 20 and f["detected"]
    if delay is None:
        delay = f["steps_to_detection"]
        assert 1 <= delay <= 3, f
    assert f["first_violation_step"] == f["applied_step"] + delay == f["applied_step"] + f["steps_to_detection"]
    assert set(kernels) <= set(f["kernels"]) and reasons <= set(f["reasons"]) and later <= set(f["all_reasons"])
    if kind in ("kv-flip", "position", "token", "swa-evict", "spec-reject", "row-recycle", "kv-flip-last",
                "offload-foreign"):
        assert f["kernels"] == kernels and set(f["reasons"]) == reasons
    if kind == "zero-kv":  # a mid-window position: no write chains from the zero slot
        assert f["kernels"] == kernels
    assert f["slot"] > 0 and f["position"] >= 0 and f["requests"] and f["violations"] >= 1
    assert c["violations"] == f["violations"] and c["unattributed_violations"] == 0  # all attributed to it
    assert "kv-canary replay: injected faults" in text and f"FAULT {kind}@20: slot {f['slot']}" in text


def test_all_faults_at_once_and_in_a_sliding_window(tmp_path):
    for extra in ([], SWA):
        kinds = [k for k in KINDS if (extra or k not in SWA_ONLY) and k not in LAYERS_ONLY
                 and k not in PD_KINDS + RANK_KINDS and not (extra and k in OFFLOAD_ONLY)]
        args = [a for k in kinds for a in ("--inject", f"{k}@30")]
        # Ten requests for nine faults (two each for overwrite and row-recycle), running at once, and the restores
        # of four more (full attention: the tier is refused with a sliding window): a longer run.
        rc, s = _replay(tmp_path, *args, *extra, *([] if extra else OFFLOAD), "--max-requests", "24")
        faults = s["canary"]["faults"]
        assert rc == 0 and [f["kind"] for f in faults] == kinds
        assert all(f["detected"] and f["steps_to_detection"] <= 1 for f in faults), faults
        requests = [r for f in faults for r in f["requests"]]
        assert len(requests) == len(set(requests))  # each fault on its own requests
        assert s["canary"]["unattributed_violations"] == 0


def test_swa_evict_is_reported_missing_at_its_position(tmp_path):
    rc, s = _replay(tmp_path, "--inject", "swa-evict@20", *SWA)
    (f,) = s["canary"]["faults"]
    assert rc == 0 and f["detected"] and f["reasons"] == f["all_reasons"] == ["MISSING"]
    assert f["what"] == f"slot {f['slot']} pos {f['position']}" and len(f["requests"]) == 1


def test_swa_evict_needs_a_sliding_window(capsys):
    """Without --swa-window there is no LUT to clear: refused before the run, naming the fault and the option
    (run, it would end in NOT DETECTED, which reads like a canary miss)."""
    msg = _refused(capsys, "--inject", "swa-evict@20")
    assert msg.startswith("kv-canary: argument --inject: swa-evict@20 needs --swa-window (a sliding window"), msg


@pytest.mark.parametrize("kind", ["kv-flip", "zero-kv", "swa-evict", "kv-flip-last"])
def test_mid_window_kinds_need_a_window_of_four(capsys, kind):
    """A window of 3 has no position that is neither its first nor the write's seed: refused before the run."""
    msg = _refused(capsys, "--inject", f"{kind}@5", "--swa-window", "3", "--num-layers", "2")
    assert msg == f"kv-canary: argument --inject: {kind}@5 needs --swa-window >= 4 (or none), which this run does " \
                  "not have (it could never be applied)", msg


def test_the_hooks_still_say_what_a_fault_needs():
    """Callers other than the command line (the tests' engine) get the reason in the fault's description."""
    from canary.replay.faults import Fault

    f = Fault("swa-evict", 3, needs="--swa-window")
    assert f.describe(10) == "not applied: needs --swa-window"


def test_kv_flip_last_needs_layers_and_names_the_layer(tmp_path, capsys):
    """Without --num-layers >= 2 nothing reads the last layer: refused before the run. With 4 layers the
    rotation finds it within 4 steps, in the layer-3 rows only (the main verify reads layer 0)."""
    msg = _refused(capsys, "--inject", "kv-flip-last@20")
    assert msg.startswith("kv-canary: argument --inject: kv-flip-last@20 needs --num-layers >= 2"), msg
    rc, s = _replay(tmp_path, "--inject", "kv-flip-last@20", "--inject", "kv-flip@20", "--num-layers", "4")
    text = capsys.readouterr().out
    last, first = s["canary"]["faults"]
    assert rc == 0 and s["canary"]["num_layers"] == 4 and s["canary"]["unattributed_violations"] == 0, text
    assert last["detected"] and 1 <= last["steps_to_detection"] <= 4 and last["kernels"] == ["verify_layer"]
    assert first["detected"] and first["steps_to_detection"] == 1 and first["kernels"] == ["verify"]


def test_stale_row_waits_for_a_reused_row(tmp_path):
    rc, s = _replay(tmp_path, "--inject", "stale-row@0")
    (f,) = s["canary"]["faults"]
    assert rc == 0 and f["applied_step"] > 0 and f["detected"]  # no row is reused at step 0


def test_a_fault_never_applied_fails_the_run(tmp_path, capsys):
    rc, s = _replay(tmp_path, "--inject", "token@100000")
    (f,) = s["canary"]["faults"]
    assert rc == 1 and s["canary"]["failed"]
    assert f["applied_step"] is None and not f["detected"] and f["first_violation_step"] is None
    assert f["what"] == f"not applied: the trace ended at step {s['steps'] - 1}, before step 100000"
    out = capsys.readouterr().out
    assert "NOT APPLIED" in out and "NOT DETECTED" not in out  # not a canary miss
    assert f"FAULT token@100000: not applied: the trace ended at step {s['steps'] - 1}" in out


def test_a_clean_run_with_violations_fails(tmp_path, monkeypatch, capsys):
    real = canary.replay.replay_manager.ManagerReplay.run

    def run(self, step, *args, **kw):  # a stray kernel flips every V byte after step 10
        log = real(self, step, *args, **kw)
        if step.index == 10:
            self.kv.v ^= 1
        return log

    monkeypatch.setattr(canary.replay.replay_manager.ManagerReplay, "run", run)
    rc, s = _replay(tmp_path, "--max-requests", "8")  # every later step reports: keep the run short
    text = capsys.readouterr().out
    c = s["canary"]
    assert rc == 1 and c["failed"] and c["violations"] == c["unattributed_violations"] + c["dropped"] > 0
    assert "VIOLATION step 11: verify slot" in text and ": REAL_KV, token" in text


@pytest.mark.parametrize("value", ["bogus@3", "kv-flip", "kv-flip@x", "kv-flip@-1", "@4"])
def test_bad_inject_values(capsys, value):
    with pytest.raises(SystemExit) as exc:
        cli.main(["replay", "--inject", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert ("argument --inject: expected KIND@STEP with KIND one of kv-flip, overwrite, position, token, stale-row, "
            "zero-kv, swa-evict, spec-reject, row-recycle") in err
    assert f"got {value!r}" in err


def test_no_canary_flag(capsys):
    # The canary always runs (--plan-only turns it off): the old no-op --canary is an unknown argument now.
    with pytest.raises(SystemExit) as exc:
        cli.main(["replay", "--canary"])
    assert exc.value.code == 2 and "unrecognized arguments: --canary" in capsys.readouterr().err


@pytest.mark.parametrize("fault", ["kv-flip@3", "token@3"])
def test_inject_on_numba_arrays_needs_cupy(monkeypatch, capsys, fault):
    monkeypatch.setattr(canary.replay.replay, "_placement", lambda backend: "numba")
    assert cli.main(["replay", "--max-requests", "2", "--inject", fault]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("kv-canary: --inject: expected CuPy") and captured.out == "", captured


def test_numba_arrays_alone_plan_only(monkeypatch, capsys):
    monkeypatch.setattr(canary.replay.replay, "_placement", lambda backend: "numba")
    host_arrays = canary.replay.replay._Arrays
    monkeypatch.setattr(canary.replay.replay, "_Arrays", lambda kind: host_arrays("host"))  # no GPU here
    assert cli.main(["replay", "--max-requests", "2"]) == 0
    err = capsys.readouterr().err
    assert "kv-canary: note: Numba device arrays only (no CuPy): planning only, as with --plan-only" in err


def test_readme_replay_canary_command(tmp_path, capsys):
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## The replay"):readme.index("## Performance")]
    commands = [line.strip("`") for line in re.findall(r"`kv-canary replay [^`]*--inject[^`]*`", section)]
    assert len(commands) == 1, commands
    argv = shlex.split(commands[0])[1:]
    out = tmp_path / "readme.json"
    assert cli.main([*argv, "--json", str(out)]) == 0, capsys.readouterr().out
    faults = json.loads(out.read_text())["canary"]["faults"]
    assert faults and all(f["detected"] for f in faults)
