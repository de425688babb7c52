"""fxshard.planner.milp: the planner's MILPs run in a child process; a crash there is retried once, then a ShardingError."""

import logging
import os
import signal
import sys

import numpy as np
import pytest
from scipy.optimize import Bounds, LinearConstraint, milp as scipy_milp
from scipy.sparse import csr_array

from fxshard.planner import milp
from fxshard.core.errors import ShardingError


def _assignment(n: int = 12, seed: int = 0) -> dict:
    """n jobs on 3 machines (binary x[j, k], each job on one machine), a capacity per machine, random costs."""
    rng = np.random.default_rng(seed)
    cost = rng.uniform(1, 10, size=3 * n)
    size = rng.uniform(1, 4, size=n)
    rows, cols, coef = [], [], []
    for j in range(n):  # each job placed once
        for k in range(3):
            rows.append(j), cols.append(3 * j + k), coef.append(1.0)
    for k in range(3):  # machine k's load
        for j in range(n):
            rows.append(n + k), cols.append(3 * j + k), coef.append(size[j])
    cap = size.sum() / 2.5
    return {"cost": cost, "integer": np.ones(3 * n), "lb": np.zeros(3 * n), "ub": np.ones(3 * n),
            "rows": np.array(rows), "cols": np.array(cols), "coef": np.array(coef),
            "row_lb": np.array([1.0] * n + [-np.inf] * 3), "row_ub": np.array([1.0] * n + [cap] * 3)}


def _in_process(p: dict):
    a = csr_array((p["coef"], (p["rows"], p["cols"])), shape=(len(p["row_lb"]), len(p["cost"])))
    return scipy_milp(p["cost"], integrality=p["integer"], bounds=Bounds(p["lb"], p["ub"]),
                      constraints=LinearConstraint(a, p["row_lb"], p["row_ub"]))


@pytest.fixture
def fresh_child():
    """Each test starts without a solver process and leaves none behind."""
    milp.stop()
    yield
    milp.stop()


def _crashing_child(tmp_path, times: int) -> list[str]:
    """A solver command whose first ``times`` processes read a request and abort (SIGABRT, as a corrupted heap
    does); later ones are the real child."""
    count = tmp_path / "starts"
    code = ("import os, pickle, sys, runpy\n"
            f"p = {str(count)!r}\n"
            "n = int(open(p).read()) if os.path.exists(p) else 0\n"
            "open(p, 'w').write(str(n + 1))\n"
            f"if n < {times}:\n"
            "    pickle.load(sys.stdin.buffer)\n"
            "    os.abort()\n"
            f"runpy.run_path({str(milp._SCRIPT)!r}, run_name='__main__')\n")
    return [sys.executable, "-P", "-c", code]


def test_the_child_solves_as_scipy_does_in_process_and_is_restarted_after_it_dies(fresh_child):
    p = _assignment()
    want = _in_process(p)
    got = milp.solve(**p, options={})
    assert want.status == 0 and got.status == 0 and got.success
    assert np.array_equal(got.x, want.x) and got.x.sum() == 12  # every job placed, the same plan
    [child] = milp._idle
    assert child.pid != os.getpid()
    os.kill(child.pid, signal.SIGKILL)  # died between solves (e.g. the OOM killer): the next solve starts another
    child.wait()
    again = milp.solve(**_assignment(seed=1), options={})
    assert np.array_equal(again.x, _in_process(_assignment(seed=1)).x)
    assert [c.pid for c in milp._idle] != [child.pid] and len(milp._idle) == 1


def test_a_solve_while_another_child_is_busy_gets_a_child_of_its_own(fresh_child):
    milp.prestart()
    busy = milp._take()  # as a solve in another thread holds it
    p = _assignment(seed=4)
    assert np.array_equal(milp.solve(**p, options={}).x, _in_process(p).x)
    [other] = milp._idle
    assert other is not busy and busy.poll() is None and other.poll() is None
    milp._give_back(busy)
    assert milp.solve(**p, options={}).success and len(milp._idle) == 2


def test_a_solver_crash_is_solved_again_in_a_new_process_with_presolve_off(fresh_child, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(milp, "_command", lambda: _crashing_child(tmp_path, 1))
    p = _assignment(seed=2)
    with caplog.at_level(logging.WARNING, logger="fxshard.planner.milp"):
        got = milp.solve(**p, options={})
    assert np.array_equal(got.x, _in_process(p).x)
    assert (tmp_path / "starts").read_text() == "2"
    assert "killed by SIGABRT" in caplog.text and "presolve off" in caplog.text, caplog.text


def test_a_solver_that_crashes_twice_is_a_sharding_error(fresh_child, tmp_path, monkeypatch):
    monkeypatch.setattr(milp, "_command", lambda: _crashing_child(tmp_path, 2))
    with pytest.raises(ShardingError, match=r"crashed twice .*killed by SIGABRT; then killed by SIGABRT.*planner='greedy'"):
        milp.solve(**_assignment(seed=3), options={})
    assert not milp._idle


def test_a_solver_error_is_a_sharding_error_and_the_child_lives_on(fresh_child):
    p = _assignment()
    with pytest.raises(ShardingError, match=r"internal: .*MILP raised in scipy \(ValueError: .*planner='greedy'"):
        milp.solve(**{**p, "lb": p["lb"][:-1]}, options={})  # bounds of the wrong length
    [child] = milp._idle
    assert child.poll() is None
    assert np.array_equal(milp.solve(**p, options={}).x, _in_process(p).x)
    assert milp._idle == [child]


def test_a_forked_process_solves_in_a_child_of_its_own(fresh_child):
    """After fork (e.g. a DataLoader worker that shards), the parent's idle child is not the forked process's:
    sharing its pipes would mix the two conversations; and the forked process's exit does not end it."""
    p, q = _assignment(seed=5), _assignment(seed=6)
    milp.solve(**p, options={})
    [parent_child] = milp._idle
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the forked process: solve, report, exit without running the parent's test machinery
        ok = False
        try:
            ok = not milp._idle and np.array_equal(milp.solve(**q, options={}).x, _in_process(q).x) \
                and milp._idle[0] is not parent_child
            milp.stop()
        finally:
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.waitpid(pid, 0)
    assert milp._idle == [parent_child] and parent_child.poll() is None
    assert np.array_equal(milp.solve(**p, options={}).x, _in_process(p).x)


def test_scipy_missing_in_the_solvers_interpreter_is_a_sharding_error_naming_it(fresh_child, tmp_path, monkeypatch):
    (tmp_path / "scipy").mkdir()
    (tmp_path / "scipy" / "__init__.py").write_text("raise ImportError('no scipy here')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the child's scipy is this broken package
    with pytest.raises(ShardingError, match=r"does not import in the solver's process .*no scipy here.*pip install"):
        milp.solve(**_assignment(), options={})


def test_a_child_that_died_while_idle_is_replaced_without_blaming_the_problem(fresh_child, monkeypatch, caplog):
    """The send to a child that died after it was taken (e.g. the OOM killer) fails before it read anything:
    another child gets the same request, with presolve as asked, and nothing is reported as a crash."""
    milp.prestart()
    [dead] = milp._idle
    milp._idle.clear()
    dead.kill()
    dead.wait()
    real, handed = milp._take, []

    def take():
        if not handed:
            handed.append(dead)
            return dead
        return real()

    monkeypatch.setattr(milp, "_take", take)
    p = _assignment(seed=7)
    with caplog.at_level(logging.WARNING, logger="fxshard.planner.milp"):
        assert np.array_equal(milp.solve(**p, options={}).x, _in_process(p).x)
    assert handed == [dead] and not caplog.text, caplog.text


def test_highs_tuning_reaches_highs_silently_and_a_scipy_that_rejects_it_solves_without_it(fresh_child, monkeypatch,
                                                                                            capfd, tmp_path):
    """``milp.HIGHS_TUNING`` goes to HiGHS verbatim (a zero time limit there stops the search), silently (scipy's
    warnings about options it passes on or skips stay in the child); a scipy that raises on the tuning (as
    one whose HiGHS binding lacks an option does) solves without it."""
    p = _assignment(seed=7)
    assert milp.HIGHS_TUNING and np.array_equal(milp.solve(**p, options={}).x, _in_process(p).x)
    monkeypatch.setattr(milp, "HIGHS_TUNING", {"time_limit": 0.0})
    assert milp.solve(**p, options={}).status == 1  # HiGHS's time limit
    monkeypatch.setattr(milp, "HIGHS_TUNING", {"mip_heuristic_run_rins": False, "no_such_highs_option": True})
    assert np.array_equal(milp.solve(**p, options={}).x, _in_process(p).x)
    assert "Unrecognized options" not in capfd.readouterr().err
    milp.stop()
    strict = ("import runpy, scipy.optimize as o\n"
              "real = o.milp\n"
              "def milp(*a, options=None, **k):\n"
              "    if set(options) - {'disp', 'presolve', 'time_limit', 'node_limit', 'mip_rel_gap'}:\n"
              "        raise AttributeError('HighsOptions has no attribute')\n"
              "    return real(*a, options=options, **k)\n"
              "o.milp = milp\n"
              f"runpy.run_path({str(milp._SCRIPT)!r}, run_name='__main__')\n")
    monkeypatch.setattr(milp, "_command", lambda: [sys.executable, "-P", "-c", strict])
    got = milp.solve(**p, options={})
    assert got.status == 0 and np.array_equal(got.x, _in_process(p).x)
