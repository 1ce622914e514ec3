"""A step's life: admission, scheduler, step value, runner, sampling; new step features go here."""
