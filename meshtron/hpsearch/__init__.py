"""``meshtron hpsearch``: learning rate, warm-up, batch and weight decay searched on proxy runs
(Optuna studies over short ``meshtron train`` trials)."""
