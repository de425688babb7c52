"""The process ``fxshard.planner.milp`` solves MILPs in: run as a script (``python -P milp_child.py``), never imported.

Reads pickled requests from stdin until end of file; answers each with one pickled reply on the stdout
it started with. Its fd 1 is pointed at stderr first, so HiGHS's log (``disp``) cannot mix into the
replies. Imports numpy and scipy only (not fxshard, not torch).

A request is a dict with ``cost``, ``integer``, ``lb``, ``ub`` (per variable), ``rows``, ``cols``, ``coef``
(the constraint matrix as triplets), ``row_lb``, ``row_ub`` (per row), ``options`` (``scipy.optimize.milp``'s) and
``highs`` (HiGHS options passed verbatim; dropped if this scipy rejects one).
A reply is ``{"x", "status", "success", "message", "mip_gap"}`` from ``scipy.optimize.milp``,
``{"import_error": "<type>: <message>"}`` when numpy or scipy does not import, or
``{"error": "<type>: <message>"}`` when building or solving the problem raised.
"""

import os
import pickle
import sys
import warnings


def _solve(milp, req, *args, **kwargs):
    """``milp`` with the request's options and its HiGHS tuning (``highs``: passed to HiGHS verbatim, which
    scipy warns about; an option this HiGHS does not know is skipped by scipy); solved again without the
    tuning when this scipy raises on it."""
    tuning = req.get("highs") or {}
    if tuning:
        try:
            with warnings.catch_warnings():  # scipy's (and its HiGHS wrapper's) notes that it passes them on
                warnings.filterwarnings("ignore", "Unrecognized options")
                return milp(*args, **kwargs, options={**req["options"], **tuning})
        except (AttributeError, KeyError, TypeError, ValueError):
            pass
    return milp(*args, **kwargs, options=req["options"])


def main() -> None:
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    try:
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import csr_array
    except ImportError as e:
        imported = f"{type(e).__name__}: {e}"
    else:
        imported = None
    while True:
        try:
            req = pickle.load(requests)
        except EOFError:
            return
        if imported is not None:
            reply = {"import_error": imported}
        else:
            try:
                a = csr_array((req["coef"], (req["rows"], req["cols"])), shape=(len(req["row_lb"]), len(req["cost"])))
                res = _solve(milp, req, np.asarray(req["cost"]), integrality=np.asarray(req["integer"]),
                             bounds=Bounds(np.asarray(req["lb"]), np.asarray(req["ub"])),
                             constraints=LinearConstraint(a, np.asarray(req["row_lb"]), np.asarray(req["row_ub"])))
                reply = {"x": res.x, "status": res.status, "success": res.success, "message": res.message,
                         "mip_gap": getattr(res, "mip_gap", None)}
            except Exception as e:  # the parent turns it into a ShardingError
                reply = {"error": f"{type(e).__name__}: {e}"}
        pickle.dump(reply, replies, protocol=pickle.HIGHEST_PROTOCOL)
        replies.flush()


if __name__ == "__main__":
    main()
