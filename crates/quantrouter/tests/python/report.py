"""How the client scripts report: "ok <check>" for each check that holds, and CheckFailed on
the first that does not. `passed` counts the checks that held."""

passed = 0


class CheckFailed(Exception):
    pass


def check(name, condition, detail=""):
    global passed
    if not condition:
        raise CheckFailed(f"{name}: {detail!r}")
    passed += 1
    print(f"ok {name}", flush=True)
