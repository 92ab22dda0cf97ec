"""`pdserve bench sim-disagg --suite`: colocated, every P:D split, `auto` and the field's rules
over a suite of workloads, models and SLOs, each layout at its best engine settings, on the
planner's virtual cluster (pdserve/planner).

- `workloads.py` — the suite's workloads: chat, code, rag, agentic, their mix, phase-shifting.
- `suite.py` — one cell (workload x model x SLOs): each layout family's best goodput.
- `curves.py` — `--plot`: each family's best layout offered load below, at and past saturation.
- `plots.py` — `--plot`: goodput vs rate per model and workload, and the summary table.
- `paired.py` — `--at-rates`: the families' SLO attainment at the same offered rates.
- `targets.py` — issue 49's targets on one cell.
- `coverage.py` — every cell of the suite's `--json` files in one table.
- `screen.py` — `--screen`: each documented figure on its steady probe, the highest down.
- `confirmed.py` — the coverage table of the figures a screen found to hold.
- `command.py` — the `--suite` arguments, the run over every cell, the targets and the table.
"""
