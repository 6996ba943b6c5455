"""Planning (SPEC 3): the plan buffers (:mod:`.plans`), the planner and SGLang's one-shot entry point
(:mod:`.planner`), and the per-row rules shared with the reference (:mod:`.rows`)."""
