"""Direct logit attribution and the logit lens: the arithmetic on tensors and token ids, with
the final norm's scale frozen at the run being decomposed. The sources (bundled model, Hugging
Face models) hand over the residual stream's parts as the model's own modules wrote them."""
