"""Pipeline parallelism: which layers each stage holds (:mod:`.partition`), schedules as data
with their simulation (:mod:`.schedules`) and timeline plot (:mod:`.timeline`), and the executor
that runs any schedule (:mod:`.executor`)."""
