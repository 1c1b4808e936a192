"""The EAGLE-3 drafter: its model, the training-time-test objective, the draft vocabulary and the
SGLang export."""
