"""Shared values, the bottom layer every other one may use: the plan object (`plan`), typed stage results
(`results`), the packed batch and its token ids (`batch`, `tokenizer`), the hardware catalogue (`catalog`)
and the training loss (`loss`)."""
