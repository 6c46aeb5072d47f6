"""``meshtron tune``: the command around the cost model, and what checks the model against the
machine (calibration, trial runs through the real trainer). Above training, since it runs it."""
