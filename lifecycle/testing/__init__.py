"""Test doubles shipped for users' own suites: the scripted worker (a wire-compatible peer
with no model) and the pytest plugin with fault-injection fixtures. Production code never
imports this package; the CLI only spawns the scripted worker by module name."""
