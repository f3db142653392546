"""Training: the corpus (data.py), the losses, the greedy generator of self-distillation
(generate.py), a workdir (workdir.py) and the trainer (trainer.py)."""
