"""What a rank learns about its surroundings: its place in the job and its hardware."""
