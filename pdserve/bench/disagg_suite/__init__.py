"""`pdserve bench sim-disagg --suite`: colocated, every P:D split, `auto` and the field's rules
over a suite of workloads, models and SLOs, each layout at its best engine settings, on the
planner's virtual cluster (pdserve/planner)."""
