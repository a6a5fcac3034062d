"""What guards promises and checks (`guards.contracts`): the classifier, the output checks and
the token estimate against hostile text in linear time, a client's `max_tokens`, the settings
checks and the errors naming a missing extra."""
