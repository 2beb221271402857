"""Model surgery: the attention of chosen layers and heads of a given model computed by kernapprox estimators."""
