"""Mixed precision: autocast policy and dynamic loss scaling."""
