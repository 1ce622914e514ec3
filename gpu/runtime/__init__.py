"""A step's life: admission, the scheduler, the step value, the runner that chooses the
backends once and runs the model, sampling, stops, logprobs, grammars, and the books that turn
a step into STEP entries. A new step feature goes here."""
