"""Speculative decoding: a proposer guesses the next tokens of a sequence, the target model
computes them all in one step, and the sampling rank keeps the longest run it would have
sampled itself (meshserve.engine.speculative.verify).

- proposer.py: the Proposer interface and the n-gram prompt-lookup proposer;
- policy.py: how many tokens each sequence drafts in a step (its acceptance so far against
  what one more token costs the step);
- verify.py: the acceptance rule on the sampling rank.
"""
