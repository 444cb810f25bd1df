"""The executors of a plan (cuda/, reference/) and the host passes they share."""
