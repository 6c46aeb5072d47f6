"""The cost model: step time and memory of a layout on a cluster profile, and the layout search
that ranks by it. Pure arithmetic on configs (nothing here runs a process or trains), so it sits
below training: online re-tuning (``train.autotune``) prices the running plan with it directly."""
