"""What a caller asks of a load: ``LoadOptions``, validated once and taken by every face, and the answers
when it does not say (``defaults``: where a load computes, the generation dtype)."""
