"""torch.fx passes: capture a model, price its nodes, rewrite checkpoint regions."""
